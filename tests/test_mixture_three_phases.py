"""A data mixture with three phases (train.json's `data` and two `data_phases`): every window of every source is read
at most once per epoch of that source across all three phases, a source's whole epoch reads each of its windows, and
each phase reads its sources at its own weights. Two phases cannot show a phase that forgets what the phases before
the previous one read: only a third phase starts after more than one earlier phase."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
from mixturehelp import WEIGHTS, mixture
from trainhelp import make_run

from nanopt.config import load_run
from nanopt.data.mixtures.interleave import Interleave
from nanopt.data.mixtures.mixture import MixtureLoader, open_run_data

SEQ_LEN = 32  # make_run's model context: every sample is one window of 32 + 1 tokens
PER_STEP = 16  # 2 ranks x micro-batch 4 x 2 micro-steps
# Phase 0 (data): web 0.7, code 0.2, math 0.1 for steps 0-19; phase 1: web and math alike for steps 20-39; phase 2:
# code 1, math 3 for steps 40-69. Code is read in phases 0 and 2 (not 1), math in all three: 32 + 160 + 360 = 552
# samples, past its 444 windows, so its first epoch ends inside the third phase.
PHASES = [{"from": 20, "mixture": {"web": 1, "math": 1}}, {"from": 40, "mixture": {"code": 1, "math": 3}}]
STEPS = 70
PHASE_WEIGHTS = [(range(0, 20), WEIGHTS), (range(20, 40), {"web": 0.5, "code": 0.0, "math": 0.5}),
                 (range(40, 70), {"web": 0.0, "code": 0.25, "math": 0.75})]


def windows_of(sources: dict[str, Path]) -> tuple[dict[bytes, tuple[str, int]], dict[str, int]]:
    """Each window's tokens (seq_len + 1 of them, starting at a multiple of seq_len) -> (source, window number), and
    each source's number of windows: a batch row is identified by what it holds, not by the loader's bookkeeping."""
    from nanopt.data.dataset import TokenDataset

    where: dict[bytes, tuple[str, int]] = {}
    counts: dict[str, int] = {}
    for name in WEIGHTS:
        stream = TokenDataset.open(sources[name]).stream("train")
        count = (stream.total - 1) // SEQ_LEN
        rows = stream.windows(np.arange(count, dtype=np.int64) * SEQ_LEN, SEQ_LEN + 1)
        counts[name] = count
        for window, row in enumerate(rows):
            where.setdefault(row.tobytes(), (name, window))
    return where, counts


def test_three_phases_read_each_window_of_each_source_at_most_once_per_epoch(tmp_path: Path,
                                                                               mixture_sources: dict[str, Path]):
    sources = mixture_sources
    run = make_run(tmp_path, sources["web"], data=mixture(sources), data_phases=PHASES, max_steps=STEPS,
                   global_batch_tokens=PER_STEP * SEQ_LEN)
    config = load_run(run)
    assert [phase.start_step for phase in config.mixture.phases] == [0, 20, 40]
    loaders = [MixtureLoader(open_run_data(config), "train", SEQ_LEN, 4, 2, rank, 2, config.train.seed)
               for rank in range(2)]
    where, windows = windows_of(sources)
    steps = []
    for _ in range(STEPS):
        samples = []
        for _ in range(2):  # micro-steps, then ranks: the global order of a step's samples
            for loader in loaders:
                inputs, targets = loader.next_batch()
                rows = np.concatenate([inputs.numpy(), targets.numpy()[:, -1:]], axis=1)
                samples += [where[row.tobytes()] for row in rows]
        steps.append(samples)

    # Each phase reads its sources at its weights, exactly (the blocks of 10, 2 and 4 samples fit in a step).
    for span, weights in PHASE_WEIGHTS:
        names = [name for step in span for name, _ in steps[step]]
        assert {name: names.count(name) for name in WEIGHTS} == {
            name: round(weight * PER_STEP * len(span)) for name, weight in weights.items()}, span
    read = [sample for step in steps for sample in step]
    assert sum(1 for name, _ in read if name == "math") > windows["math"]  # math's first epoch ended in phase 2
    for name, size in windows.items():
        order = [window for source, window in read if source == name]
        for start in range(0, len(order), size):
            epoch = order[start:start + size]
            repeated = len(epoch) - len(set(epoch))
            assert repeated == 0, f"{name}: epoch {start // size} re-reads {repeated} of its {len(epoch)} samples"
            if len(epoch) == size:  # a whole epoch reads every window
                assert sorted(epoch) == list(range(size)), name


def test_each_source_counts_its_samples_on_across_any_number_of_phases():
    """The interleave itself, for random mixtures of 3 to 5 phases (some leaving a source out): the index each
    sample gets within its source is how many samples that source gave before it, over every earlier phase, as a
    plain count over the samples in order finds it; and `given_before` is that count at every phase boundary."""
    chance = random.Random(3)
    for _ in range(40):
        sources = chance.randint(2, 4)
        count = chance.randint(3, 5)
        starts = [0, *sorted(chance.sample(range(1, 400), count - 1))]
        weights = []
        for _ in starts:
            raw = [chance.choice([0, 0, 1, 2, 3, 7]) for _ in range(sources)]
            if not any(raw):
                raw[chance.randrange(sources)] = 1
            weights.append(tuple(value / sum(raw) for value in raw))
        interleave = Interleave(starts, weights)
        total = starts[-1] + chance.randint(1, 300)
        source, index = interleave.locate(np.arange(total, dtype=np.int64))
        given = [0] * sources
        for sample in range(total):
            if sample in starts:
                assert interleave.given_before(sample).tolist() == given, (starts, weights, sample)
            assert index[sample] == given[source[sample]], (starts, weights, sample)
            given[source[sample]] += 1
        for phase, start in enumerate(starts):  # and no sample of a phase comes from a source it leaves out
            end = starts[phase + 1] if phase + 1 < len(starts) else total
            assert all(weights[phase][s] > 0 for s in source[start:end]), (starts, weights, phase)
