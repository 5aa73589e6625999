"""One physics for planner, simulator and runtime: every rule and formula of SPEC §2-§4 defined once.

- :mod:`echo2.physics.rules`: the staleness budget (kappa from S, the admission rule ``v >= v_t - S``),
  the provisioning slack gamma and the install quorum it implies, the bubble ratio and the knee rule.
- :mod:`echo2.physics.broadcast`: dissemination times of the broadcast strategies and the lower bound
  ``T*``, in bytes and bytes/s.

Pure: no I/O, no clock, no torch. Everything above this package calls it; it imports only errors.
"""
