"""The tasks of `conv2d demo`: `digits` (the main job: an all-convolutional classifier on
scikit-learn's digits), `breakout` (DQN on MinAtar Breakout, acting at batch 1 and
training at batch 32 through the same layers) and `fit` (a student layer learns to match
a teacher layer: a numerical check)."""
