"""A small word-level tokenizer for the built-in tasks, built offline with `tokenizers`.

Vocabulary: [PAD] [BOS] [EOS] [UNK], the punctuation "?" "=" and the word "count", keys k0..,
values v0.., filler words f0.., digits 0..9. One word is one token, so prompt lengths in tokens are
exact. Saved and loaded like any transformers tokenizer (`save_pretrained` / `AutoTokenizer`).
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]


def task_vocabulary(num_keys: int = 64, num_values: int = 16, num_filler: int = 32) -> list[str]:
    words = SPECIALS + ["?", "=", "count"]
    words += [f"k{i}" for i in range(num_keys)] + [f"v{i}" for i in range(num_values)]
    words += [f"f{i}" for i in range(num_filler)] + [str(d) for d in range(10)]
    return words


def build_tokenizer(num_keys: int = 64, num_values: int = 16, num_filler: int = 32) -> PreTrainedTokenizerFast:
    words = task_vocabulary(num_keys, num_values, num_filler)
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]", unk_token="[UNK]"
    )
