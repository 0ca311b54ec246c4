"""One process, no pipeline: a model trained three steps of 4 micro-batches (forward / engine.backward / engine.step,
as train.py's non-pipelined path runs them) three ways from the same weights and micro-batches, at ZeRO argv[1] in
fp32, clipping at argv[2] (0.05 bites), on argv[3]'s model (`gptlite`: GPTlite tiny; `plain`: a model of plain
nn.Embedding and nn.Linear layers, which LeanEngine makes deferrable); with argv[4] `nan`, the second step's first
loss is multiplied by NaN (its gradients are not finite: the step is skipped):

- `deepspeed`: DeepSpeed's own engine, built by deepspeed.initialize;
- `lean-not-in-place`: schedules.initialize's LeanEngine, its weight gradients handed to autograd as DeepSpeed's
  path has them;
- `lean`: LeanEngine as it runs (weight gradients added in place).

Run by tests/test_lean_engine.py through local_launch. Prints one JSON line: per engine its class, whether its step
is ours (ZeRO 1), whether it accumulates in place, DeepSpeed's hooks left, whether the weights are the fp32 master
partition, the losses and last norm; and against `deepspeed`, whether the weights and the optimizer's state are
equal bit for bit, and their largest difference.
"""
import json
import sys
from datetime import timedelta

import deepspeed
import torch

import gptlite
import schedules
from schedules.runtime import lean_step

MODES = ("deepspeed", "lean-not-in-place", "lean")
VOCAB = 97


def config(zero, clip):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01,
                                                      "torch_adam": True, "fused": True}},
            "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


class Plain(torch.nn.Module):
    """Plain torch layers: an embedding, two linear layers, a LayerNorm; logits over VOCAB tokens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.fc = torch.nn.Linear(16, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, ids):
        return self.head(self.norm(torch.relu(self.fc(self.embed(ids)))))


def build(mode, zero, clip, model_name):
    model = gptlite.get_model(model_size="tiny", seed=3, vocab_size=VOCAB) if model_name == "gptlite" else Plain()
    init = deepspeed.initialize if mode == "deepspeed" else schedules.initialize
    engine, *_ = init(model=model, model_parameters=list(model.parameters()), config=config(zero, clip))
    if mode == "lean-not-in-place":
        engine._in_place = False
    return engine


def state(engine):
    """(the weights, every tensor of the optimizer's state), flattened."""
    opt = engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    weights = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    moments = torch.cat([v.reshape(-1).float() for group in inner.param_groups for p in group["params"]
                         for k, v in sorted(inner.state[p].items()) if torch.is_tensor(v)])
    return weights, moments


def _float(value):
    return None if value is None else float(value)  # (DeepSpeed's ZeRO-0 clipping keeps no norm)


def main(zero, clip, model_name, nan=False):
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    g = torch.Generator().manual_seed(0)
    steps = [[(torch.randint(0, VOCAB, (2, 16), generator=g), torch.randint(0, VOCAB, (2, 16), generator=g))
              for _ in range(4)] for _ in range(3)]
    seen = {}
    for mode in MODES:
        engine = build(mode, zero, clip, model_name)
        losses = []
        for step, batches in enumerate(steps):
            for k, (x, y) in enumerate(batches):
                loss = gptlite.CrossEntropyLoss_FlatView(engine(x), y)  # GPTlite's head, or the plain model's logits
                engine.backward(loss * float("nan") if nan and (step, k) == (1, 0) else loss)
                engine.step()
                losses.append(loss.item())
        opt = engine.optimizer
        seen[mode] = {"engine": type(engine).__name__, "our_step": getattr(engine, "_zero1_step", None) is not None,
                      "in_place": getattr(engine, "_in_place", False),
                      "hooks": len(getattr(opt, "_grad_acc_hooks", [])),
                      "weights_are_master": zero == 1 and lean_step.master_is_weights(opt),
                      "losses": losses, "norm": _float(engine.get_global_grad_norm()),
                      "steps": engine.global_steps, "skipped": engine.skipped_steps, "state": state(engine)}
    reference = seen["deepspeed"]["state"]
    out = {}
    for mode, s in seen.items():
        weights, moments = s.pop("state")
        s["weights_equal"] = torch.equal(weights, reference[0])
        s["moments_equal"] = torch.equal(moments, reference[1])
        s["weights_diff"] = (weights - reference[0]).abs().max().item()
        out[mode] = s
    print(json.dumps(out))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], nan=sys.argv[4:] == ["nan"])
