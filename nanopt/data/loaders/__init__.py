"""The loaders training, eval, find-batch and profile read batches through: the resumable distributed loader
(loader), one per sequence-length stage (staged_loader), and the seeded pointwise permutation that shuffles windows
in O(1) memory (permutation)."""
