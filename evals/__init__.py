"""Frozen-encoder evaluation: probes and the checkpoint leaderboard, on the octfm floor and the trainer's model."""
