"""A dataset's prompts tokenized once (`longstraw.tasks.token_cache`): the ids are the tokenizer's own, a second run
reads the file without tokenizing, another tokenizer or other rows get a file of their own, an interrupted build
leaves none, and a run with the cache is the run without it, metric for metric."""

import json

import pytest
import torch

from longstraw.tasks import build_tokenizer
from longstraw.tasks.token_cache import TokenCache
from longstraw.train.config import TrainConfig
from longstraw.train.trainer import Trainer

from ..train.test_shared_prefix_step import DOC

TEXTS = [DOC + " ? k9", "k3 v1 ? k3", DOC + " ? k9", "f1 " * 300 + "? k5"]


class Counting:
    """A tokenizer that counts its calls (the real one underneath)."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.tok(*args, **kwargs)


def test_ids_are_the_tokenizers_and_a_second_build_reads_the_file(tmp_path):
    tok = build_tokenizer()
    counting = Counting(tok)
    cache = TokenCache(tmp_path, counting, TEXTS)
    assert cache.built and counting.calls == 3 and len(cache) == 3  # the repeated text once
    for text in TEXTS:
        want = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        got = cache.ids(text)
        assert got.dtype == torch.long and torch.equal(got, want)
    assert cache.ids("k1 v2") is None
    again = Counting(tok)
    reread = TokenCache(tmp_path, again, TEXTS)
    assert not reread.built and again.calls == 0 and reread.path == cache.path
    assert torch.equal(reread.ids(TEXTS[3]), cache.ids(TEXTS[3]))


def test_another_tokenizer_or_other_rows_get_a_file_of_their_own(tmp_path):
    base = TokenCache(tmp_path, build_tokenizer(), TEXTS).path
    other_vocab = TokenCache(tmp_path, build_tokenizer(num_keys=32), TEXTS).path
    other_rows = TokenCache(tmp_path, build_tokenizer(), TEXTS[:2]).path
    assert len({base, other_vocab, other_rows}) == 3


def test_an_interrupted_build_leaves_no_file(tmp_path):
    tok = build_tokenizer()

    def failing(text, **kwargs):
        if text == TEXTS[1]:
            raise KeyboardInterrupt
        return tok(text, **kwargs)

    class Failing(Counting):
        def __call__(self, *args, **kwargs):
            return failing(*args, **kwargs)

    with pytest.raises(KeyboardInterrupt):
        TokenCache(tmp_path, Failing(tok), TEXTS)
    assert list(tmp_path.iterdir()) == []
    assert TokenCache(tmp_path, tok, TEXTS).built  # built afresh, whole


def test_a_run_with_the_cache_is_the_run_without_it_and_tokenizes_no_prompt_per_step(tmp_path):
    rows = [{"prompt": DOC + f" ? k{9 * q}", "answer": f"v{q % 16}"} for q in range(1, 5)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(name, cache):
        cfg = TrainConfig(model="llama", dataset=str(data), eval_fraction=0.0, output_dir=str(tmp_path / name),
                          num_steps=2, prompts_per_step=2, num_generations=2, max_completion_length=3, chunk_size=8,
                          threads=1, progress=False, eval_examples=2, token_cache=cache, lora=False, learning_rate=5e-2,
                          reward_funcs=["tests.train.test_shared_prefix_step:length_reward"])
        trainer = Trainer(cfg)
        counting = Counting(trainer.tok)
        trainer.policy.tokenizer = counting
        out = trainer.train()
        return out, counting.calls

    cached, calls = run("cached", str(tmp_path / "tokens"))
    plain, plain_calls = run("plain", None)
    for key in ("loss", "reward", "entropy", "grad_norm", "prompt_length"):
        assert [m[key] for m in cached] == [m[key] for m in plain], key
    assert plain_calls >= 4 and calls == 0  # 2 steps × 2 prompts (and the evaluation's) tokenized without the cache
