"""Statistical efficiency: pure maths on gradient norms.

Owns the fused squared-norm kernels (`sqnorm`: Numba CUDA and CPU) and the gradient-noise-scale
estimators, efficiency and AdaScale gain (`noise_scale`). May import numpy, torch and numba; never
Horovod, mpi4py, `comm` or any other plane of this package.
"""
