"""MTP draft-head training behind `laneserve train-mtp` (not serving code)."""
