"""Downstream tasks scored the way lm-evaluation-harness 0.4.x scores them: HellaSwag, ARC, PIQA, LAMBADA and
Winogrande, zero-shot, with the checkpoint's own tokenizer.

catalog: each task's dataset (hub name, config, split) and how a record becomes prompts, as the harness renders it.
sources: records from the hub through `datasets`, or from a local jsonl (--task-data) in the same schema.
scorer: the log-likelihood of each (context, continuation) pair, in fixed-shape batches on every rank.
metrics: acc, acc_norm, acc_per_token, LAMBADA accuracy and perplexity, centered accuracy, standard errors.
downstream: the four together for a loaded model, the one entry point for `nanopt eval --tasks`.
"""
