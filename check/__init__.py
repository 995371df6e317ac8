"""The learning check (`make learning-check`): does pretraining learn something a random encoder
lacks, on a cohort where the answer is known? A harness on a floor of its own above `evals/`: it
uses the commands users run to evaluate an encoder (probes, fine-tuning) and nothing below imports
it (tests/test_layers.py). docs/learning-check.md keeps the decisions behind it."""
