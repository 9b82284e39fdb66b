"""One optimizer step: `accum` micro-batches forward and backward, clipping, and the step itself, or its skip.

Every decision that could make ranks diverge (skip a non-finite step, stop for preemption) is taken from values
all-reduced over the ranks, so every rank always enters the same collectives.
"""

from __future__ import annotations

import math

import torch

from nanopt.errors import NanoptError
from nanopt.runtime import all_reduce_sum_
from nanopt.train.optim.optimizer import optimizers_of, set_lr
from nanopt.train.optim.schedule import recovery_lr_multiplier, scheduled_lr
from nanopt.train.precision.scaling import scaled, unscale, update
from nanopt.train.session import Session
from nanopt.untrusted_text import shell_word


class TrainingDiverged(NanoptError):
    """Too many consecutive non-finite steps."""


def step(s: Session) -> tuple[float, float, bool]:
    """One optimizer step over `accum` micro-batches; returns (mean loss over ranks, grad norm, stop?). A step whose
    record will be logged also measures the health signals into `s.health_signals` (nanopt.train.health.probe)."""
    st, cfg = s.state, s.run.train
    probe = s.health_probe if s.health_probe is not None and logged(s, st.step + 1) else None
    ramp = recovery_lr_multiplier(st.step, st.lr_ramp_start, st.lr_ramp_factor, cfg.recovery_lr_steps)
    set_lr(s.optimizer, scheduled_lr(st.step, s.total_steps, cfg) * ramp)
    loss_sum = torch.zeros((), device=s.rt.device)
    scaler = s.train_state.scaler  # fp16 only (nanopt.train.precision.scaling)
    # s.accum, or fewer during batch warmup: the data's step's (ahead of st.step after a recovery skipped data); its
    # tokens, whatever its sequence-length stage
    accum, tokens = s.loader.accum_at(s.loader.step), s.loader.tokens_in(s.loader.step)
    if s.prepared.weight_copies is not None:
        s.prepared.weight_copies.refresh()  # the weights as this step's micro-batches must see them
    if s.prepared.graphed is not None:
        s.prepared.graphed.begin_step(accum)
    for micro in range(accum):
        inputs, targets = s.loader.next_batch()  # token ids already checked by the loader
        inputs = inputs.to(s.rt.device, non_blocking=True)
        targets = targets.to(s.rt.device, non_blocking=True)
        with s.prepared.gradient_sync(micro == accum - 1):
            loss = _forward_backward(s, inputs, targets, accum, scaler)
        loss_sum += loss.detach().float()
    unscale(scaler, optimizers_of(s.optimizer))
    if probe is not None:
        probe.gradients()  # unscaled (fp16), before clipping, as the global norm is
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    norm = _local(torch.nn.utils.clip_grad_norm_(s.prepared.raw.parameters(), max_norm, foreach=True))
    s.loader.plan_ahead()  # the next step's read and check, before the sync below drains the device
    mean_loss, any_bad, any_stop, norm_value = _agree(s, loss_sum / accum, norm)
    if any_bad:
        _skip_nonfinite(s, mean_loss, norm_value)
    else:
        if probe is not None:
            probe.before_update()
        s.optimizer.step()
        if probe is not None:
            probe.after_update()
        st.consecutive_nonfinite = 0
    update(scaler, any_bad)
    s.optimizer.zero_grad(set_to_none=True)
    if probe is not None:
        s.health_signals = probe.read()
    st.step += 1
    st.tokens += tokens
    st.last_loss = mean_loss
    return mean_loss, norm_value, any_stop


def _forward_backward(s: Session, inputs: torch.Tensor, targets: torch.Tensor, accum: int,
                      scaler: torch.amp.GradScaler | None) -> torch.Tensor:
    """One micro-batch's loss, its gradients added into `.grad`: replayed from a CUDA graph when train.json's
    cuda_graphs is on (nanopt.train.parallel.graphed_step), else run."""
    if s.prepared.graphed is not None:
        return s.prepared.graphed.run(inputs, targets)
    with s.rt.autocast():
        loss = s.prepared.model(inputs, targets)
    scaled(scaler, loss / accum).backward()
    return loss


def logged(s: Session, step: int) -> bool:
    """Whether step `step`'s record is logged: every log_interval steps, and the last."""
    return step % s.run.train.log_interval == 0 or step == s.total_steps


def _agree(s: Session, loss_mean: torch.Tensor, norm: torch.Tensor) -> tuple[float, bool, bool, float]:
    """(mean loss over ranks, did any rank see a non-finite value, was any rank asked to stop, this rank's grad
    norm): one all-reduce and the step's one host sync, so every rank takes the same branch.

    The sync comes before optimizer.step() on purpose: skipping a non-finite step on the device (fused AdamW's
    found_inf) would leave the host to learn of it a step late, after the spike and recovery logic had already
    judged that step's numbers. The stop flag is filled on the device from a Python number (torch.full: a kernel,
    no host-to-device copy that would wait for the backward); the norm rides along in the same read.
    """
    bad = (~torch.isfinite(loss_mean) | ~torch.isfinite(norm)).float()
    stop = torch.full((), float(s.preempt_requested), device=s.rt.device)
    reduced = all_reduce_sum_(s.rt, torch.stack([loss_mean, bad, stop]).double())
    # The norm is on the CPU when FSDP2 offloads the gradients there ("fsdp_offload").
    norm = norm.detach().double().reshape(1).to(reduced.device)
    loss, any_bad, any_stop, norm_value = torch.cat([reduced, norm]).tolist()
    return loss / s.rt.world_size, any_bad > 0, any_stop > 0, norm_value


def _local(norm: torch.Tensor) -> torch.Tensor:
    """FSDP2 returns the (already global) norm as a DTensor; use its local value."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _skip_nonfinite(s: Session, loss: float, norm: float) -> None:
    st = s.state
    st.skipped_steps += 1
    st.consecutive_nonfinite += 1
    s.metrics.write("event", step=st.step + 1, event="nonfinite_skipped", loss=loss, grad_norm=norm)
    s.observer.note(f"step {st.step + 1}: non-finite loss or gradient (loss {loss}, grad norm {norm}); "
                    f"optimizer step skipped ({st.consecutive_nonfinite} in a row)")
    # With recovery on, the loop rolls back instead (nanopt.train.guard.recovery), and raises this when it cannot.
    if st.consecutive_nonfinite >= s.run.train.max_nonfinite_steps and not s.run.train.recovery:
        raise diverged(s, f"{st.consecutive_nonfinite} non-finite steps in a row at step {st.step + 1}")


def diverged(s: Session, what: str) -> TrainingDiverged:
    """The error that stops a run that diverged: `what` says how, the hint how to go on by hand."""
    return TrainingDiverged(
        f"training diverged: {what}",
        f"resume from the last checkpoint with a lower learning rate, e.g. `nanopt train {shell_word(s.run.run_dir)} "
        f"--set learning_rate={s.run.train.learning_rate / 2:g} --allow-changed`")
