"""`GRPOTrainer`'s checkpoints where TRL writes them: `output_dir/checkpoint-N`, loaded by PEFT's own
`PeftModel.from_pretrained`, holds the model the trainer had at step N (a forward's logits compared with the trainer's
model's, taken in `on_save` at that step); a resume from that folder continues the run to the same weights."""

import torch
from transformers import TrainerCallback

from longstraw import GRPOTrainer

from .test_trl_shape import ROWS, _args, _weights, reward_len

IDS = torch.tensor([[1, 5, 9, 14, 3, 7, 2, 11]])


class LogitsAtSave(TrainerCallback):
    """The trainer's model's logits on `IDS` at each checkpoint, by step; the step each `train` call began at."""

    def __init__(self):
        self.logits: dict[int, torch.Tensor] = {}
        self.first_steps: list[int] = []

    def on_step_begin(self, args, state, control, **kw):
        if not self.first_steps or self.first_steps[-1] == -1:
            self.first_steps[-1:] = [state.global_step]

    def on_train_begin(self, args, state, control, **kw):
        self.first_steps.append(-1)

    def on_save(self, args, state, control, model=None, **kw):
        with torch.no_grad():
            self.logits[state.global_step] = model(IDS).logits.detach().clone()


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def test_checkpoint_n_loads_with_peft_as_the_trainers_model_at_step_n_and_resumes(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    seen = LogitsAtSave()
    trainer = GRPOTrainer(model="llama", reward_funcs=reward_len, args=_args(tmp_path, "run"), train_dataset=ROWS,
                          peft_config=_lora(), callbacks=[seen])
    trainer.train()
    final = _weights(trainer)
    out = tmp_path / "run"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert set(seen.logits) == {2, 4}
    for step, want in seen.logits.items():
        folder = out / f"checkpoint-{step}"
        base = AutoModelForCausalLM.from_pretrained(folder / "base")
        with torch.no_grad():
            before = base(IDS).logits
            loaded = PeftModel.from_pretrained(base, folder)
            got = loaded(IDS).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(before, want, atol=1e-4)  # the adapter trained: not the base's logits
    assert not torch.allclose(seen.logits[2], seen.logits[4], atol=1e-4)

    again = LogitsAtSave()
    redo = GRPOTrainer(model="llama", reward_funcs=reward_len, args=_args(tmp_path, "run"), train_dataset=ROWS,
                       peft_config=_lora(), callbacks=[again])
    assert redo.train(resume_from_checkpoint=str(out / "checkpoint-2")).global_step == 4
    assert again.first_steps == [2]  # steps 3 and 4
    got = _weights(redo)
    assert all(torch.equal(final[k], got[k]) for k in final)
