"""mgrpo: GRPO on Megatron-Core."""

__version__ = "0.1.0"
