"""What every model.json and train.json key means, for scripts/config_reference.py, which writes docs/config.md from
the config schema (nanopt/config/model_config.py and nanopt/config/schema.py: each key's type, default and allowed
values) and this file (what the schema's code cannot say: a one-line meaning, the range its checks enforce, and the
full description the README's tables gave).

A new key in either dataclass fails tests/test_config_reference.py until it has a line in MODEL or TRAIN here; then
`make docs` writes the page. Text is markdown; the generator joins each string's lines and wraps it again.
"""

from __future__ import annotations

# One line each: what the key is for.
MODEL = {
    "architecture": 'the block: "llama" (RoPE, RMSNorm, SwiGLU, grouped-query attention) or "gpt2" (learned '
                    "positions, LayerNorm, GELU MLP, biases)",
    "vocab_size": "rows of the embedding and the output head (the dataset's vocabulary, or padded past it)",
    "hidden_size": "the width of the residual stream",
    "num_hidden_layers": "transformer blocks",
    "num_attention_heads": "query heads; they divide hidden_size",
    "max_position_embeddings": "the context: the longest sequence (gpt2's learned position table); seq_len's default",
    "intermediate_size": "the MLP's width",
    "num_key_value_heads": "key / value heads (grouped-query attention); they divide num_attention_heads",
    "rope_theta": "RoPE's base (llama)",
    "rope_scaling": "Llama 3's RoPE frequency scaling (Llama 3.1 / 3.2), in transformers' keys",
    "rms_norm_eps": "RMSNorm's epsilon (llama; also qk_norm's)",
    "layer_norm_eps": "LayerNorm's epsilon (gpt2)",
    "tie_word_embeddings": "the output head shares the embedding's weights",
    "attention_bias": "biases on the attention projections (o_proj alone when qkv_bias is given)",
    "mlp_bias": "biases on the MLP's projections",
    "dropout": "dropout probability",
    "initializer_range": "the standard deviation of the initial weights",
    "qkv_bias": "biases on the q, k, v projections",
    "qk_norm": "RMSNorm on each head's queries and keys, before RoPE (Qwen3)",
    "init": "how the projections are initialized",
    "document_masking": "attention stops at EOS: each token sees its own document only",
    "eos_token_id": "the token that ends a document (the dataset's eos_id)",
}

TRAIN = {
    "data": "the dataset directory made by `nanopt tokenize`, or a mixture of several",
    "micro_batch_size": "sequences per rank per forward pass",
    "global_batch_tokens": "tokens per optimizer step over all ranks",
    "train_tokens": "the budget in tokens (or max_steps)",
    "max_steps": "the budget in optimizer steps (or train_tokens)",
    "seq_len": "the training sequence length",
    "learning_rate": "the peak learning rate",
    "min_lr_ratio": "the final learning rate as a fraction of the peak",
    "lr_schedule": "the schedule after linear warmup",
    "warmup_steps": "linear warmup's length in steps",
    "decay_fraction": "WSD: the share of the steps spent decaying",
    "weight_decay": "AdamW's weight decay (matrices and embeddings only)",
    "beta1": "AdamW's first-moment decay",
    "beta2": "AdamW's second-moment decay",
    "adam_eps": "AdamW's epsilon",
    "grad_clip": "the gradient norm clipped to (0: off)",
    "eval_interval": "steps between in-loop validations (0: off)",
    "eval_tokens": "validation tokens scored at each in-loop evaluation",
    "downstream_tasks": "downstream tasks scored at in-loop evaluations",
    "downstream_interval": "steps between downstream scorings",
    "downstream_examples": "the first N examples of each downstream task",
    "downstream_task_data": "a local folder of task records instead of the hub",
    "checkpoint_interval": "steps between checkpoints (the last step always saves)",
    "keep_checkpoints": "checkpoints kept by retention",
    "checkpoint_async": "write checkpoints in the background",
    "log_interval": "steps between metrics lines",
    "health": "run health's signals and verdicts at each log step",
    "seed": "initialization and data order",
    "precision": "the training dtype",
    "tf32": "CUDA: fp32 matmuls on TF32 tensor cores",
    "compile": "torch.compile",
    "cuda_graphs": "one GPU: each micro-batch replayed from a CUDA graph",
    "bf16_residual": "the residual stream between blocks in bf16, opt-in",
    "bf16_weight_copies": "the blocks' linear layers from bf16 weight copies made once per step",
    "fp8": "FP8 matmuls, opt-in",
    "activation_checkpointing": "recompute block activations in backward",
    "parallelism": "how ranks split the model and optimizer state under torchrun",
    "optimizer": "the optimizer",
    "muon_learning_rate": "Muon's peak learning rate",
    "max_nonfinite_steps": "consecutive non-finite (skipped) steps before a rollback or a stop",
    "spike_threshold": "standard deviations above the rolling mean that make a loss spike",
    "recovery": "roll back and train on after a confirmed spike or divergence",
    "recovery_confirm_steps": "consecutive spiking steps that confirm a spike",
    "recovery_skip_steps": "extra steps' worth of batches skipped after a rollback",
    "recovery_lr_factor": "the learning-rate multiplier right after a rollback",
    "recovery_lr_steps": "steps over which the rate ramps back after a rollback",
    "max_recoveries": "rollbacks per run",
    "price_per_hour": "USD per GPU-hour for the live cost and the summary",
    "on_exit": "a shell command rank 0 runs once when the run ends",
    "on_exit_timeout_s": "seconds after which the on_exit command is killed",
    "stall_timeout_s": "seconds without progress after which a stall is reported (0: off)",
    "tensorboard": "also log every metrics.jsonl record to TensorBoard",
    "wandb_project": "a W&B project name turns Weights & Biases on",
    "wandb_mode": "W&B online or offline",
    "data_phases": "a mixture per phase of the run",
    "data_epochs_warning": "warn when a mixture's source is read more times than this",
    "batch_warmup_tokens": "batch-size warmup: tokens over which the batch ramps up",
    "batch_warmup_start_tokens": "batch-size warmup: the first global batch",
    "seq_len_stages": "sequence-length stages",
}

# The ranges the configs' checks enforce, where the type alone does not say (the listed values of a choice come
# from the schema's Literal types).
ALLOWED = {
    "vocab_size": "1 to 2^24", "hidden_size": "1 to 2^24", "num_hidden_layers": "1 to 2^24",
    "num_attention_heads": "1 to 2^24, dividing hidden_size", "max_position_embeddings": "1 to 2^24",
    "intermediate_size": "1 to 2^24", "num_key_value_heads": "1 to 2^24, dividing num_attention_heads",
    "rope_theta": "> 0", "rms_norm_eps": "> 0", "layer_norm_eps": "> 0", "initializer_range": "> 0",
    "dropout": "[0, 1)", "eos_token_id": "[0, vocab_size)",
    "micro_batch_size": "> 0", "global_batch_tokens": "> 0, a multiple of micro_batch_size x seq_len x ranks",
    "train_tokens": "> 0", "max_steps": "> 0", "seq_len": "1 to max_position_embeddings",
    "learning_rate": "> 0", "min_lr_ratio": "[0, 1]", "decay_fraction": "(0, 1]", "warmup_steps": ">= 0",
    "weight_decay": ">= 0", "beta1": "[0, 1)", "beta2": "[0, 1)", "adam_eps": "> 0", "grad_clip": ">= 0",
    "eval_interval": ">= 0", "eval_tokens": "> 0", "downstream_interval": ">= 0, a multiple of eval_interval",
    "downstream_examples": "> 0", "checkpoint_interval": ">= 0", "keep_checkpoints": "> 0", "log_interval": "> 0",
    "seed": ">= 0", "activation_checkpointing": 'false, true, k >= 1 (every k-th block), "selective"',
    "muon_learning_rate": "> 0", "max_nonfinite_steps": "> 0", "spike_threshold": "> 0",
    "recovery_confirm_steps": "> 0", "recovery_skip_steps": ">= 0", "recovery_lr_factor": "(0, 1]",
    "recovery_lr_steps": ">= 0", "max_recoveries": "> 0", "price_per_hour": "0 to 1,000,000",
    "on_exit_timeout_s": "1 to 86,400", "stall_timeout_s": "0 to 604,800", "data_epochs_warning": "> 0",
    "wandb_project": "up to 128 characters, none of / \\ # ? % :",
}

# What a default of null means, where it means more than "off".
NULL_MEANS = {
    "intermediate_size": "4 x hidden (gpt2), the Llama 8/3 rule rounded to 256 (llama)",
    "num_key_value_heads": "num_attention_heads (no GQA)",
    "attention_bias": "true for gpt2, false for llama",
    "mlp_bias": "true for gpt2, false for llama",
    "qkv_bias": "as attention_bias",
    "seq_len": "max_position_embeddings",
    "train_tokens": "the budget is max_steps (exactly one of the two is given)",
    "max_steps": "the budget is train_tokens (exactly one of the two is given)",
    "downstream_interval": "eval_interval",
    "price_per_hour": "the GPU table's price",
    "wandb_mode": "online with an API key or after `wandb login`, else offline",
    "downstream_task_data": "the hub",
}

# The README's tables: (keys, default as the table gave it, the full description). Every key has MODEL / TRAIN's
# one line; these say the rest, under the key's heading in docs/config.md.
MODEL_DETAILS = [
    (('qkv_bias',), 'as `attention_bias`', """
        biases on the q, k, v projections; `attention_bias` then sets o_proj's alone. GPT-2 small with the
        tokenizer's 50257 rows, an untied head and `"qkv_bias": false` has the 163,009,536 parameters a
        published GPT-2 163M run counted
        """),
    (('qk_norm',), '`false`', """
        RMSNorm (`rms_norm_eps`, a weight of head_dim) on each head's queries and keys, before RoPE, as Qwen3
        """),
    (('init',), '`"normal"`', """
        `"normal"`: every weight drawn with std `initializer_range`; `"fan_in"`: the projections with std
        1/sqrt(fan_in) (their in_features), the embeddings and the output head still with `initializer_range`.
        Either way o_proj and down_proj are scaled by 1/sqrt(2 x layers)
        """),
    (('document_masking',), '`false`', """
        attention stops at EOS: in a packed row each token sees only the earlier tokens of its own document, and
        positions restart at 0 with each document, so a row computes what its documents would alone (a row that
        starts mid-document treats that part as one). Needs `eos_token_id`
        """),
    (('eos_token_id',), '`null`', """
        the token that ends a document: the dataset's `eos_id` (its meta.json); `nanopt train` refuses another
        in one line
        """),
    (('rope_scaling',), '`null`', """
        Llama 3's RoPE frequency scaling (Llama 3.1 / 3.2), in transformers' keys: Llama 3.2's is `{"rope_type":
        "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}`. With L the original context, a frequency whose wavelength is
        under L / high_freq_factor stays, one over L / low_freq_factor is divided by `factor`, and those between
        blend the two (`nanopt/model/rope.py`). llama only; `"llama3"` is the only type; the numbers positive, L
        an integer, low below high, each mistake one line. It changes no shape: parameters, FLOPs and memory are
        those without it. `nanopt import` writes it; `nanopt export` writes it back as both `rope_scaling` and
        `rope_parameters`
        """),
]

TRAIN_DETAILS = [
    (('data',), 'required', """
        dataset directory made by `nanopt tokenize`; a relative path is relative to the run directory
        (`"../../data/stdlib"` for `runs/demo`), so every command finds it from any working directory; `--set
        data=DIR` is relative to the current directory, like any path typed in a shell, and so are the paths of a
        mixture given with `--set 'data={...}'` (a source keyed by its path keeps that key as its name). Messages
        show the path train and eval look at one way: with `..` folded (`data/stdlib`, not
        `runs/demo/../../data/stdlib`) and relative to the current directory when under it. A resume may follow a
        moved dataset: only its contents must stay the same. Or a mixture: `{"NAME": {"path": DIR, "weight": W},
        ...}` or `{DIR: W, ...}` (see [a data mixture](tutorials/mixture.md))
        """),
    (('data_phases',), 'none', """
        a mixture per phase: `[{"from": 0.9 \\| STEP \\| "decay", "mixture": {"NAME": W, ...}}, ...]`, in the
        order they start
        """),
    (('data_epochs_warning',), '4', """
        a mixture's source read more than this many times over the run is warned about at start-up (and flagged
        by `estimate` / `preflight`)
        """),
    (('micro_batch_size',), 'required', """
        sequences per rank per forward pass (`nanopt find-batch` finds it)
        """),
    (('global_batch_tokens',), 'required', """
        tokens per optimizer step over all ranks
        """),
    (('batch_warmup_tokens', 'batch_warmup_start_tokens'), 'none (off)', """
        batch-size warmup: the global batch starts at `batch_warmup_start_tokens` and ramps linearly to
        `global_batch_tokens` over the first `batch_warmup_tokens` tokens, in whole multiples of the start (see
        [batch-size warmup](training.md#batch-size-warmup)). Both or neither; not with a data mixture; cannot
        change on resume
        """),
    (('train_tokens', 'max_steps'), 'one required', """
        the budget, in tokens or optimizer steps. More tokens than the train split holds train several epochs:
        each reads every sequence once in a fresh seeded order, a resume mid-epoch continues exactly, and the
        run warns once how many epochs it is (also a `data_repeats` event in metrics.jsonl)
        """),
    (('seq_len',), '`max_position_embeddings`', """
        training sequence length (and evaluation's, throughout a run with stages)
        """),
    (('seq_len_stages',), 'none (off)', """
        sequence-length stages: `[{"from": 0.9 \\| STEP, "seq_len": L}, ...]`, in the order they start: from a
        fraction of the run (rounded to the nearest step) or a step number on, train sequences of L tokens, a
        micro-batch keeping its tokens (see [sequence-length stages](training.md#sequence-length-stages)). L at
        most the model's `max_position_embeddings`, and cutting `micro_batch_size x seq_len` into whole
        sequences; not with batch warmup or a data mixture; cannot change on resume
        """),
    (('learning_rate', 'min_lr_ratio'), '6e-4, 0.1', """
        peak LR and the final LR as a fraction of it
        """),
    (('lr_schedule',), '`cosine`', """
        `cosine`, `wsd` (warmup-stable-decay) or `constant`, after linear warmup
        """),
    (('warmup_steps', 'decay_fraction'), '100, 0.2', """
        warmup length; WSD's final decay share
        """),
    (('weight_decay', 'beta1', 'beta2', 'adam_eps', 'grad_clip'), '0.1, 0.9, 0.95, 1e-8, 1.0', """
        AdamW and clipping (0: off)
        """),
    (('eval_interval', 'eval_tokens'), '250, 1048576', """
        in-loop validation every N steps (0: off) on a fixed slice
        """),
    (('downstream_tasks',), 'none (off; `runs/gpt2-small`: `"hellaswag,arc_easy,piqa"`)', """
        downstream tasks scored at in-loop evaluations, comma-separated names as `nanopt eval --tasks` takes
        them (`"hellaswag,arc_easy"`, or `"all"`): inside the eval phase (their time counts there, in the phase
        table, and in the evaluation-cost warning, spread over `downstream_interval`), into metrics.jsonl's
        `eval` records as `task_NAME_METRIC` and `downstream_s` (so TensorBoard and W&B get them too), onto
        loss.png (accuracy in percent on a right-hand axis: `acc_norm` where the task has it, else `acc`) and
        into the end-of-run table (the latest scores). A misspelt name is one line before training; a task that
        cannot be loaded (no network, a missing or unreadable file) is turned off for the session with a
        warning, and the run goes on. Nothing is scored when `eval_interval` is 0. Changing this key,
        `downstream_examples` or `downstream_task_data` when resuming counts as a changed setting
        (`--allow-changed`)
        """),
    (('downstream_interval',), '`eval_interval` (`runs/gpt2-small`: 1000)', """
        steps between downstream scorings: a multiple of `eval_interval` (tasks are scored at in-loop
        evaluations; anything else is one line before training), 0 for none; the last step always scores. Free
        to change on resume
        """),
    (('downstream_examples',), '500 (`runs/gpt2-small`: 500)', """
        the first N examples of each downstream task, loaded and tokenized once per session
        """),
    (('downstream_task_data',), 'none (the hub)', """
        a folder like `nanopt eval --task-data`'s (`TASK.jsonl` or a `save_to_disk` folder `TASK/`), relative to
        the run directory
        """),
    (('checkpoint_interval', 'keep_checkpoints'), '500, 3', """
        checkpoint cadence and retention (the last step always saves; retention never deletes the newest, the
        one `best` names, one a reader holds, or the imported model a run continues from)
        """),
    (('checkpoint_async',), '`true`', """
        write checkpoints in the background: the step waits only for a copy of the state to host memory, and
        that copy (each rank's own part; the whole state on one process) is kept between saves. `false`: every
        save waits for its files and frees its copy, for machines short of host memory
        """),
    (('log_interval',), '10', """
        steps between metrics lines
        """),
    (('health',), 'true', """
        run health at each log step: per-block gradient norms, update-to-parameter ratios, share of steps
        clipped, loss trend, and their verdicts (see [run health](health.md))
        """),
    (('seed',), '1337', """
        initialization and data order
        """),
    (('precision',), '`auto`', """
        `auto` (bf16 on CUDA GPUs that have it, fp16 on CUDA GPUs without it such as T4 and V100, fp32 on the
        CPU), `bf16`, `fp16` (CUDA only: autocast with `torch.amp.GradScaler`'s dynamic loss scaling; an
        overflowing step is skipped and counted as a non-finite step, the scale and its growth count are in the
        checkpoint's meta.json as `loss_scale`), `fp32`
        """),
    (('tf32',), 'true', """
        CUDA: fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa). `false`: true fp32, the
        reference a bf16 run is compared with; training then reports no MFU (the GPU table has no true-fp32
        peak). Recorded in checkpoints, eval.json, the profile summary and preflight.json; changing it on resume
        needs `--allow-changed`
        """),
    (('compile',), '`auto`', """
        torch.compile: `auto` is on for CUDA, off on the CPU
        """),
    (('cuda_graphs',), 'false', """
        One GPU: each micro-batch's forward and backward captured once as a CUDA graph and replayed, which removes
        the host's launch gaps between kernels; the arithmetic is the same. Captured again for a new micro-batch
        shape (a sequence-length stage). Refused in one line on the CPU, with more than one rank and in fp16. Off
        until a GPU window measures what it gains (bench/RESULTS.md)
        """),
    (('bf16_residual',), 'false', """
        The residual stream between blocks kept in bf16 instead of fp32 (the norms still compute in fp32): less
        activation memory and traffic, each residual addition rounded to bf16, so it changes the numerics and is
        opt-in. Needs `precision` bf16 (one line otherwise). Weights, checkpoints and exports are the same either
        way; changing it on resume needs `--allow-changed`
        """),
    (('bf16_weight_copies',), 'false', """
        The blocks' linear layers compute from bf16 copies of their weights, made once per optimizer step, instead
        of casting each fp32 weight on every micro-batch; their weight gradients come out of the GEMM in fp32 where
        torch and the GPU can (else the bf16 product, cast, exactly as autocast gives). Fewer bytes moved per
        micro-batch, for 2 bytes per weight kept for the run. Needs `precision` bf16, and DDP or ZeRO-1 with more
        than one rank (FSDP2 makes its own bf16 copies per micro-batch); one line otherwise. Checkpoints and
        evaluation are the same either way; free to change on resume. Off until a GPU window measures what it gains
        (bench/RESULTS.md)
        """),
    (('fp8',), '`off`', """
        FP8 matmuls, opt-in (see [FP8](fp8-and-muon.md#fp8)): `head` (the output head's GEMMs inside the loss,
        torch alone), `all` (also the blocks' larger linear layers, through torchao: `pip install
        'nanopt[fp8]'`). GPUs with FP8 tensor cores only (compute capability 8.9+: Ada, Hopper, Blackwell),
        bf16; `all` also needs `compile` and torch 2.11 or newer. Anything else is one line before training.
        Weights, checkpoints and exports are the same either way; changing it on resume needs `--allow-changed`
        """),
    (('activation_checkpointing',), 'false', """
        recompute block activations in backward: `true` (every block), `k` (every k-th block), `"selective"`
        (every block, matmul and attention outputs kept, element-wise ops recomputed)
        """),
    (('parallelism',), '`ddp`', """
        under torchrun, from least memory saved to most: `ddp`; `zero1` (DDP, AdamW state sharded by
        `ZeroRedundancyOptimizer`); `zero2` (FSDP2 keeping gathered weights from forward to backward); `fsdp`
        (FSDP2 `fully_shard` per block, ZeRO-3); `fsdp_offload` (FSDP2 with `CPUOffloadPolicy`: sharded weights,
        gradients and AdamW state in host memory). Every choice resumes from any other's checkpoint on any world
        size (`--allow-changed`); muon runs with `ddp`, `zero2` or `fsdp`, `adamw8bit` with all but `zero1`
        """),
    (('max_nonfinite_steps',), '5', """
        consecutive non-finite steps (skipped) before a rollback (or a stop, with `recovery` false)
        """),
    (('recovery',), 'true', """
        on a confirmed loss spike or a divergence, roll every rank back to the newest checkpoint from before it,
        skip the data being read, lower the learning rate and train on
        """),
    (('recovery_confirm_steps',), '3', """
        consecutive spiking steps (`spike_threshold`) that confirm a spike; one noisy step never rolls back
        """),
    (('recovery_skip_steps',), '10', """
        extra steps' worth of batches skipped beyond those read since the checkpoint (0: just those)
        """),
    (('recovery_lr_factor',), '0.5', """
        learning-rate multiplier right after a rollback, in (0, 1]
        """),
    (('recovery_lr_steps',), '200', """
        steps over which the rate ramps back linearly to the schedule's (0: at once)
        """),
    (('max_recoveries',), '3', """
        rollbacks per run (saved in checkpoints); one more confirmed spike or divergence stops training with
        exit 2
        """),
    (('spike_threshold',), '6.0', """
        loss spikes this many standard deviations above the rolling mean are reported
        """),
    (('optimizer',), '`adamw`', """
        `adamw`, or `muon`: PyTorch's `torch.optim.Muon` on the hidden matrices (attention and MLP projections),
        AdamW (`learning_rate`) on embeddings, head, norms and biases; one fp32 momentum buffer instead of two
        on those matrices (the memory model counts it). Whole matrices (one process, `ddp`) take torch's step
        batched by shape: the matrices of one shape go through Newton–Schulz together, bit for bit torch's
        result on the CPU with a tenth of its kernel launches. Needs torch >= 2.9; works under `ddp`, `zero2`
        and `fsdp` (FSDP2: the momentum buffers stay sharded like AdamW's moments, and each rank orthogonalizes
        its share of the whole matrices with torch's own Newton–Schulz, sent between ranks in bf16); cannot
        change on resume. Or `adamw8bit`: torchao's `AdamW8bit` (`pip install 'nanopt[lowbit]'`), the two
        moments in 8 bits with a scale per 256 values, about 2 bytes a parameter instead of 8 (the memory model
        counts it); CPU and CUDA; under `ddp`, `zero2`, `fsdp` and `fsdp_offload` (FSDP2: each rank quantizes
        its own rows, so the moments are sharded like the weights), not `zero1`. A tensor's moments are 8-bit
        when it holds 4096 values or more and its rows (dim 0) come in whole 256-value blocks with every rank's
        shard a whole number of them (on one process: torchao's own rule, a multiple of 256); norms, biases and
        shapes that do not split evenly keep fp32 moments. Its checkpoint stores each 8-bit moment as
        `<param>/exp_avg_codes` (uint8, the parameter's shape), `_scale` (fp32, [row groups, blocks per group],
        sharded by rows like the parameter) and `_qmap` (the 256-entry code book), and resumes bit for bit, also
        on another world size or FSDP2 layout (`--allow-changed`)
        """),
    (('muon_learning_rate',), '0.02', """
        Muon's peak LR; the schedule scales it by the same factor as `learning_rate`, and its weight decay
        matches AdamW's per-step shrinkage. On the demo's full budget 0.01 did best (0.005 / 0.01 / 0.02 / 0.04
        swept: see [benchmarks](benchmarks.md))
        """),
    (('tensorboard',), 'false', """
        also log every metrics.jsonl record to `runs/NAME/tensorboard/` (`tensorboard --logdir runs`): loss, LR,
        grad norm, tokens/s, MFU, peak memory, time and cost, val loss, phase times, and events as text and
        scalars; a resume drops the re-run steps as metrics.jsonl does. `pip install 'nanopt[tensorboard]'`
        """),
    (('wandb_project', 'wandb_mode'), 'none, auto', """
        a project name turns on Weights & Biases: one W&B run per session, grouped by the run's name; online
        when `WANDB_API_KEY` is set or after `wandb login`, else offline into `runs/NAME/wandb/` (`wandb sync`
        uploads it); `"offline"` forces it. `pip install 'nanopt[wandb]'`
        """),
    (('price_per_hour',), "the GPU table's price", """
        USD per GPU-hour for the live cost, the summary and `eval` comparisons (`--price-per-hour`); no default
        on a CPU or an unknown GPU
        """),
    (('on_exit', 'on_exit_timeout_s'), 'none, 300', """
        a shell command rank 0 runs once when the run ends, for any reason (`--on-exit`; see
        [training](training.md#when-the-run-ends---on-exit)), and the seconds after which it is killed. One that
        comes from train.json is printed on stderr before the first step (see [SECURITY.md](../SECURITY.md))
        """),
    (('stall_timeout_s',), '1800', """
        seconds without progress (a step, an evaluation with its checkpoint) after the first step, after which
        the run reports a stall: every rank writes every thread's Python stack to `stalls/rank-R.txt`, and rank
        0 records a `stall` event, prints a warning and runs `--on-event` with `NANOPT_EVENT=stall`;
        `stall_over` when progress resumes. It only reports: the run goes on waiting. 0: off. Raise it when one
        evaluation (downstream tasks) or checkpoint takes longer
        """),
]


# The text around the tables.
MODEL_INTRO = """
    Key names follow Hugging Face `transformers`: `architecture` (`"llama"`: RoPE, RMSNorm, SwiGLU, grouped-query
    attention; `"gpt2"`: learned positions, LayerNorm, GELU MLP, biases), `vocab_size`, `hidden_size`,
    `intermediate_size` (default 4 x hidden for gpt2, the Llama 8/3 rule for llama), `num_hidden_layers`,
    `num_attention_heads`, `num_key_value_heads` (default: no GQA), `max_position_embeddings`, `rope_theta`,
    `rms_norm_eps`, `layer_norm_eps`, `tie_word_embeddings`, `attention_bias`, `mlp_bias`, `dropout`,
    `initializer_range`.
"""

MODEL_OPTIONS_INTRO = """
    Recipe options (all off by default; a checkpoint written before them is the same model, and none of them can
    change on resume: "cannot resume: ... model.qk_norm: true -> false"):
"""

MODEL_OPTIONS_COST = """
    Each is exact in the parameter count and FLOPs (`nanopt estimate`), and counted by the memory model as autograd
    keeps it (the tests measure the tensors saved for backward): qk_norm's fp32 norm inputs and outputs per layer;
    document masking's [seq, seq] additive mask per sequence (shared by the layers), per-row RoPE tables, and on
    CUDA the grouped K/V heads expanded for the memory-efficient attention kernel, which takes the mask (flash takes
    none: `estimate` reports the kernel as `efficient`). Masked attention still computes every [seq, seq] block, so
    its time is the unmasked one's: on the CPU a training step costs 0.94-1.09x the unmasked step
    (`bench/bench_document_masking.py`, see [benchmarks](benchmarks.md)); the GPU figure is not measured yet.
    Generation (`nanopt eval` samples) continues the prompt's last document, as the mask does: the KV cache holds
    that document only and starts afresh after an EOS.
"""

TRAIN_LOGGERS = """
    TensorBoard and W&B are fed the same records as metrics.jsonl, on rank 0 only; a logging failure is one warning
    and that logger stops, training never does; a missing package is refused before any training.
"""

TRAIN_TOKEN_COUNTS = """
    Token counts (`train_tokens`, `eval_tokens`, `global_batch_tokens`, `batch_warmup_tokens`,
    `batch_warmup_start_tokens`) may be written as people write them: `"2.5B"`, `"500M"`, `"20e9"`. `--set
    train_tokens=5M` replaces train.json's `max_steps` and the reverse (naming both with `--set` decides both).
"""

TRAIN_GRAD_ACCUM = """
    Gradient accumulation is derived: `global_batch_tokens / (micro_batch_size x seq_len x world_size)`. A division
    that is not exact is an error that names values that work. Any command that takes a run directory accepts `--set
    KEY=VALUE` (repeatable) to override a train.json value for that invocation only; a model.json key (`--set
    vocab_size=1024`) is refused with the file to edit instead, as the model's shape is model.json's alone.
"""

MISTAKES = """
    Every mistake in these files (unknown key, wrong type, impossible shape, inexact batch) is one line that names
    the file and the key, with a hint, and exit status 2.
"""
