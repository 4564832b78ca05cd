"""Metrics: JSONL, W&B, dashboards and reports.

- `metrics`: the metric keys (design §6) and `required_keys(moe)`;
- `logger.RunLogger`: one step per line of `RUN_DIR/metrics.jsonl`, plus W&B (offline by default);
- `wandb_reader.read_offline_run`: the history of an offline W&B run, read from its `.wandb` log;
- `dashboard`: the panel groups shared by the W&B workspace and the report;
- `report.render_report`: `rlfw report RUN_DIR`, PNGs and one self-contained HTML page;
- `progress.progress`: tqdm bars for long phases, only on a terminal.

Submodules are imported where used: wandb and matplotlib are slow to import and most callers need one.
"""
