"""What every section of the config tree shares: strict sections, the run-wide constants."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

REQUEST_BYTES_PER_TOKEN = 32  # a completion token in a submission's JSON: its id and log-prob (~26 bytes)
USER_CONTEXT_TOKENS = 32768  # longest prompt + completion accepted when the model's context is unknown
FloatDtype = Literal["bfloat16", "float16", "float32"]  # published weights, engine compute
DEVICE_PATTERN = r"^(auto|cpu|cuda|cuda:[0-9]+)$"  # a device setting: auto, cpu, cuda or cuda:N
EngineName = Literal["hf", "vllm"]  # rollout engines (rollout/engines/: the registry maps names to classes)


class _Section(BaseModel):
    """Every section is strict about unknown keys, so a typo fails instead of being ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
