"""The command-line tools, installed as console scripts (pyproject.toml) and mirrored by `launch/` for a checkout:
mgrpo-train (train.py), mgrpo-convert (convert.py), mgrpo-serve (serve.py). One flag dialect: dialect.py."""
