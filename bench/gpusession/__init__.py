"""The one-call GPU session (bench/gpu_session.py is its entry point), split by idea:

    plan.py        the steps, their compile-aware budgets, and the check that a plan fits the call
    records.py     what every record carries, appending it, the commit, the lines printed on stdout
    isolation.py   each step in a process of its own (forked from one that imported torch once), and nanopt inside
    presets.py     the workloads' run directories in the scratch folder, and reading what a run wrote
    preflight.py   the fail-fast first step, and the data step
    throughput.py  nanopt against the compiled nanoGPT-style baseline, and memory against the memory model
    find_batch.py  `nanopt find-batch` eager, one compiled trial, against `nanopt estimate`
    training.py    bf16 against fp32, resume after a kill, profile (GPT-2 small's and the 1B Llama's)
    comparisons.py FP8 (off, head, all) against bf16, Muon against AdamW: side-by-side `nanopt train` runs
    health.py      run health's overhead (bench/bench_health.py's measurement)
    gputests.py    the GPU-marked tests, cheapest files first
    steps.py       each step's name to the function its process runs
    session.py     the parent: schedules, kills, tails results.jsonl onto stdout, prints the summary

Nothing here imports torch at import time: the parent imports it once (preload) before forking the steps.
"""
