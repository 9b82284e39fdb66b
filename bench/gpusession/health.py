"""Run health's overhead on GPT-2 small at the session's shape (bench/bench_health.py's measurement, in this step's
process): blocks of the presets' log interval alternating health on and off, and the health work timed alone."""

from __future__ import annotations

import dataclasses

from gpusession.presets import PRESETS, gpt2_micro, preset
from gpusession.records import Context, append_record, base_record

LOG_INTERVAL = 10  # every preset's (the session's copies log every step: health would probe every step)
TARGET_SHARE = 0.01  # run health costs under 1% of the step, so it can stay on by default
BLOCKS, WARMUP = 10, 2  # timed blocks per side, untimed blocks first (the compile)


def step_health(ctx: Context) -> None:
    """The record: step time off and on, their ratio (what an A/B comparison resolves), and the health work's own
    share of the steps (monitor + probe, timed alone with a device sync: what the target is judged on, since the
    ratio's noise on a busy machine is larger than 1%)."""
    from bench_health import measure_overhead
    from bench_train import with_shape

    from nanopt.config import load_run
    from nanopt.runtime import init_runtime

    micro = gpt2_micro(ctx)
    run = with_shape(load_run(preset(ctx, "gpt2-small")), micro, compile_setting=True)
    run = dataclasses.replace(run, train=dataclasses.replace(run.train, log_interval=LOG_INTERVAL))
    rt = init_runtime(run.train.precision, tf32=run.train.tf32)
    blocks, warmup = (2, 1) if ctx.smoke else (BLOCKS, WARMUP)
    m = measure_overhead(run, rt, blocks, warmup)
    share = m.monitor_share + m.probe_share
    record = base_record(ctx, "health:gpt2-small", f"python bench/bench_health.py --run {PRESETS['gpt2-small']} "
                                                   f"--micro-batch {micro} --blocks {blocks} --warmup {warmup}")
    record.update(micro_batch=micro, seq_len=run.seq_len, precision=rt.precision, compiled=True,
                  log_interval=m.interval, blocks=m.blocks, step_s_off=round(m.off_s, 6), step_s_on=round(m.on_s, 6),
                  on_off_ratio=round(m.ratio, 4), monitor_share=round(m.monitor_share, 6),
                  probe_share=round(m.probe_share, 6), health_share=round(share, 6), target_share=TARGET_SHARE,
                  within_target=share < TARGET_SHARE)
    if not ctx.smoke and share >= TARGET_SHARE:
        record["status"] = "over target"
    append_record(ctx.out, record)
