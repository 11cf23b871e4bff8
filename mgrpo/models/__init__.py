"""Megatron models built from HF configs, one small file per family."""


def __getattr__(name):
    if name == "build_model":
        from mgrpo.models.builder import build_model

        return build_model
    raise AttributeError(name)
