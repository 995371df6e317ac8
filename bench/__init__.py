"""`make bench`: performance claims measured as ratios, side by side, in one run."""
