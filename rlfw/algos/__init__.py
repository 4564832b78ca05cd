"""Pure tensor math: ratio decomposition, ESS, advantages, losses and corrections, resync rule."""
