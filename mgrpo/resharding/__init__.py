"""HF <-> megatron weights. Lazy: `mgrpo.resharding.bucket` (the wire codec) must import without megatron."""


def __getattr__(name):
    if name == "export_hf":
        from mgrpo.resharding.export import export_hf

        return export_hf
    if name == "load_hf":
        from mgrpo.resharding.load import load_hf

        return load_hf
    raise AttributeError(name)
