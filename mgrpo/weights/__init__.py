"""HF <-> megatron weights. Lazy: `mgrpo.weights.bucket` (the wire codec) must import without megatron."""


def __getattr__(name):
    if name == "export_hf":
        from mgrpo.weights.export import export_hf

        return export_hf
    if name == "load_hf":
        from mgrpo.weights.load import load_hf

        return load_hf
    raise AttributeError(name)
