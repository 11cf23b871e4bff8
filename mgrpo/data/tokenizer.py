"""Load a model folder's tokenizer so that trainer, engines and tests agree on token ids.

transformers 5.x maps a folder whose config says model_type=qwen2 to `Qwen2Tokenizer`, which applies
its own pre-tokenizer and changes the ids of a generic byte-level `tokenizer.json`. Folders saved as a
plain fast tokenizer (`TokenizersBackend` / `PreTrainedTokenizerFast`) are therefore loaded as exactly that.
"""

from __future__ import annotations

import json
import os

_PLAIN = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(model_dir: str):
    # AutoTokenizer only when needed: its import pulls in transformers' model registry (~2.6 s per process, and
    # every rank of a torchrun launch loads a tokenizer)
    from transformers import PreTrainedTokenizerFast

    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    cls = None
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            cls = json.load(f).get("tokenizer_class")
    if cls in _PLAIN and os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
