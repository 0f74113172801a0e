"""One composition for every parallelism: `parallelize(model, mesh, config)`, then one strategy object.

As torchtitan's `parallelize_llama`, the ways of splitting training are short steps applied to the
model one after the other, each on its own axis of the rank grid (mesh.py), always in this order:

1. the pipeline split (`PipelineSplit`, pipeline.py, axis pp): this stage's model chunks. It comes
   first because it copies the model, and a process group cannot be copied;
2. tensor parallelism on each chunk (`TensorParallelStep`, tensor.py, axis tp), as torchtitan cuts
   each pipeline part after the split;
3. context parallelism (`ContextParallelStep`, context.py, axis cp): ring attention, each rank
   keeping its share of every sequence;
4. expert parallelism (`ExpertParallelStep`, experts.py, the dp ranks' ep groups): each rank keeps
   its experts, which it names to the later steps (`owned_parameters`) so that data parallelism
   leaves them alone;
5. data parallelism over the DP axis (with cp, dp x cp), in one of its flavours (`--zero` picks
   it): DDP's buckets (`DataParallelStep`, ddp.py, --zero 0), ZeRO-1/2's reduce-scattering buckets
   and sharded optimizer (`ZeROStep`, zero.py), ZeRO-3's sharded units (`FullyShardStep`, fsdp.py),
   ZeRO-3 inside replicas of the dp ranks (`HybridShardStep`, hsdp.py, --dp-replicate).

`STEPS` below is that order. A step that does not apply (its degree is 1) is left out, so its
group carries no traffic. The composition reads the degrees of the configuration, never a
strategy's name: `single`, `ddp`, `zero1`..`zero3`, `hsdp`, `tp`, `pp`, `cp` and `3d` are names for
it (registry.py), not classes of their own. ARCHITECTURE.md says what a new parallelism touches
(a step in a file of its own and its line in `STEPS`; a new degree, a few lines more).

What a step may do is the `Step` class (step.py): every hook's default does nothing, so a step
overrides what its mechanism changes and nothing else, and no step knows another. `Parallel`,
the strategy the training loop calls (strategy.py says what the loop asks), asks its steps in
turn: the loss from the first step that has one (TP's is vocab-parallel); gradients finished in
reverse order (DP's buckets are waited for before the pipeline sums the tied matrix's copies);
the gradient norm from what each step says is counted elsewhere (clip.py). The micro-batches, each
cut to this rank's share first (`Step.local_batch`), are run by the runner a step brings (the
pipeline's schedule) or else by the plain loop (`Step.runner`). The model's own auxiliary loss (`TinyGPT.aux_loss`) joins
the training loss here; validation reports the language-model loss alone.
"""
from __future__ import annotations

from contextlib import ExitStack

import torch

from .clip import clip_grad_norm_
from .context import ContextParallelStep
from .ddp import DataParallelStep
from .experts import ExpertParallelStep
from .fsdp import FullyShardStep
from .hsdp import HybridShardStep
from .optim import adamw
from .pipeline import PipelineSplit
from .step import PlainLoop, Step
from .strategy import Strategy
from .tensor import TensorParallelStep
from .zero import ZeROStep

STEPS = (PipelineSplit, TensorParallelStep, ContextParallelStep, ExpertParallelStep,  # in the order they apply
         DataParallelStep, ZeROStep, FullyShardStep, HybridShardStep)


def steps_for(config, steps=STEPS) -> list[type]:
    """The step classes of a configuration, in the order they apply (`Step.applies`)."""
    return [step for step in steps if step.applies(config)]


def step_problems(config, model=None, microbatches: int | None = None) -> list[str]:
    """Every step's objections to the configuration, each line headed by the step's name: each checks
    its own options, whether it applies or not (a --schedule is wrong even where no pipeline runs it)."""
    return [f"{step.title}: {line}" for step in STEPS for line in step.problems(config, model, microbatches)]


def parallelize(model: torch.nn.Module, mesh, config, steps=STEPS) -> tuple[list[torch.nn.Module], list[Step]]:
    """This rank's model chunks, after every step of `config` in order (of `steps`), and the steps."""
    steps = [cls(mesh, config) for cls in steps_for(config, steps)]
    parts = [model]
    for i, step in enumerate(steps):
        shared = [p for before in steps[:i] for p in before.shared_parameters()]  # as the model is now
        owned = [p for before in steps[:i] for p in before.owned_parameters()]
        parts = step.apply(parts, shared, owned)
    return parts, steps


class Parallel(Strategy):
    """The strategy of every preset: the loop's questions answered by the composed steps.

    The model it returns is the one chunk itself without a pipeline, so `model(x)` is the forward
    as on one device; with a pipeline, this stage's chunks as an `nn.ModuleList`.
    """

    fp16 = True  # the plain loop and the pipeline's executor both start backward from `scale_loss`
    STEPS = STEPS  # the steps it composes (a test composes a planted copy of one in its place)

    def parallelize(self, model):
        self.parts, self.steps = parallelize(model.to(self.rt.device), self.mesh, self.config, self.STEPS)
        runners = [runner for runner in (step.runner() for step in self.steps) if runner is not None]
        if len(runners) > 1:
            raise ValueError(f"{len(runners)} steps each bring a runner of the micro-batches; one may")
        self.runner = runners[0] if runners else PlainLoop()
        return torch.nn.ModuleList(self.parts) if runners else self.parts[0]

    def make_optimizer(self, model, lr, weight_decay):
        for step in self.steps:
            optimizer = step.make_optimizer(self.parts, lr, weight_decay)
            if optimizer is not None:
                return optimizer
        return adamw(model.parameters(), lr, weight_decay)

    def lm_loss(self, logits, targets):
        for step in self.steps:
            loss = step.loss(logits, targets)
            if loss is not None:
                return loss.mean()
        return super().loss_fn(logits, targets)

    def loss_fn(self, logits, targets):
        """The training loss: the language model's, plus the model's own auxiliary term where it has one."""
        loss = self.lm_loss(logits, targets)
        aux = self.parts[-1].aux_loss()
        return loss if aux is None else loss + aux

    def no_sync(self, model):
        stack = ExitStack()
        for step in self.steps:
            stack.enter_context(step.no_sync())
        return stack

    def local_batch(self, x, y):
        for step in self.steps:
            x, y = step.local_batch(x, y)
        return x, y

    def forward_backward(self, model, batches, autocast=None):
        batches = [self.local_batch(x, y) for x, y in batches]
        loss = self.runner.forward_backward(self.parts, batches, self.loss_fn, lambda: self.no_sync(model), autocast,
                                            self.scale_loss)
        return self.no_loss() if loss is None else loss

    def no_loss(self):
        """The loss of a rank that computes none (a pipeline's first stages): NaN, until `reduce_loss`."""
        return torch.tensor(float("nan"), device=self.rt.device)

    @property
    def events(self) -> list:
        """The runner's last step, action by action (a pipeline's measured Gantt chart; none without one)."""
        return self.runner.events

    @property
    def events_origin(self) -> float:
        """When that step began, on the host's shared clock (`time.perf_counter`)."""
        return self.runner.events_origin

    def finish_backward(self, model):
        for step in reversed(self.steps):
            step.finish_backward()

    def clip_grad_norm_(self, model, max_norm):
        counted = scaled = list(model.parameters())
        groups = []
        for step in self.steps:
            counted, scaled, group = step.norm(counted, scaled)
            if group is not None:
                groups.append(group)
        return clip_grad_norm_(counted, max_norm, groups, scaled, device=self.rt.device)

    def reduce_loss(self, loss):
        loss = loss.detach().double().reshape(1)
        for step in self.steps:
            loss = step.reduce_loss(loss)
        return loss.item()

    @torch.no_grad()
    def evaluate_loss(self, model, x, y):
        """This rank's mean language-model loss on its share of (x, y); NaN on a rank that computes
        no logits (a pipeline's first stages)."""
        x, y = self.local_batch(x, y)
        logits = self.runner.forward(self.parts, x)
        return self.lm_loss(logits, y) if logits is not None else self.no_loss()

    @torch.no_grad()
    def logits(self, model, idx):
        """The full logits for `idx` on every rank: each step undoes its cut around the forward."""
        forward = lambda tokens: self.runner.forward(self.parts, tokens)  # noqa: E731
        for step in reversed(self.steps):
            forward = step.sampling(forward)
        return self.runner.share_logits(forward(idx), idx)

    def model_state(self, model):
        """This rank's weights under the whole model's names, copied (a shard is a view into a bigger
        buffer, which saving would write whole)."""
        return {name: t.clone() for part in self.parts for name, t in part.state_dict().items()}

    def load_model_state(self, model, state):
        for part in self.parts:
            part.load_state_dict({name: state[name] for name in part.state_dict()})

    def close(self, model):
        for step in reversed(self.steps):
            step.close()
