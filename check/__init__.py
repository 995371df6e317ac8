"""The learning check (`make learning-check`): does pretraining learn something a random encoder
lacks, on a cohort where the answer is known? A harness on a floor of its own above `evals/`: it
uses the commands users run to evaluate an encoder (probes, fine-tuning) and nothing below imports
it (tests/test_layers.py). docs/recipe.md (The learning check) says what it runs and why;
docs/history/learning-check.md keeps the measurements behind it."""
