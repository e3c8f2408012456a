"""Tests of the library on the model families: Flax linen and nnx, the real
layouts of Gemma, MaxText and nanoGPT, Equinox and Haiku."""
