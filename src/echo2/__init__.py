"""echo2: cheap RL post-training of LLMs with a centralized GRPO learner and remote rollout workers."""

__version__ = "0.1.0"
