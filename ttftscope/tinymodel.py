"""A tiny local model for real vLLM on the CPU: config + locally trained BPE tokenizer.

No weights are downloaded or stored: vLLM runs it with ``--load-format dummy`` (random
weights). 2 layers, hidden 256, 4 heads of 64 (CPU attention rejects head_dim 16), 2 KV
heads, a 1k-token BPE vocabulary trained here, and a chat template.

:func:`shared_tiny_model` keeps one copy per user, under a path that changes only when this
module does: vLLM keys its compile caches by the model's path, so every compiled start of the
same settings after the first (the demo's, ``run``'s, ``sweep``'s, the tests') reuses them
(measured: a default compiled start 95 s -> 72 s, its engine's init 34 -> 16 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

WORDS = ("the time to first token depends on queue prefill tokenizer allreduce engine worker step "
         "request prompt model cache prefix chunk batch load warmup graph latency server client stream "
         "token decode output gap idle rank tensor parallel schedule wait memory kernel compile").split()

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def build_tiny_model(path: str | Path, *, max_len: int = 4096, vocab: int = 1024) -> Path:
    """Write config.json, tokenizer.json and tokenizer_config.json into ``path`` (idempotent;
    built aside and moved into place whole, so processes building the same path at once never
    read a half-written model)."""
    p = Path(path)
    if (p / "config.json").exists() and (p / "tokenizer.json").exists():
        return p
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{p.name}-", dir=p.parent))
    try:
        _write_model(tmp, max_len, vocab)
        if p.exists():  # an empty or partial directory of an older version: ours replaces it
            for f in tmp.iterdir():
                os.replace(f, p / f.name)
        else:
            try:
                os.rename(tmp, p)
            except OSError:  # another process moved its copy in first: the same files
                pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return p


def shared_tiny_model() -> Path:
    """The tiny model in the user's cache (``$XDG_CACHE_HOME/ttftscope``), one copy per version
    of this module: see the module docstring for why one path matters."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ttftscope"
    return build_tiny_model(cache / f"tinymodel-{digest}")


def _write_model(p: Path, max_len: int, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) for _ in range(3000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(p / "tokenizer.json"))
    n_vocab = tok.get_vocab_size()
    (p / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": max_len, "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False, "clean_up_tokenization_spaces": False}, indent=2))
    (p / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": max_len, "rms_norm_eps": 1e-5,
        "vocab_size": n_vocab, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "rope_theta": 10000.0}, indent=2))


def prompt_of(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))
