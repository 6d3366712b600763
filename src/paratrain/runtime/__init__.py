"""The Runtime facade and what it applies: the step, collectives, speed."""
