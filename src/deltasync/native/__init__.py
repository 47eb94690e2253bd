"""The native kernels and their loader: one home that detection and layouts both use.

``loader`` builds and loads the C kernels in ``kernels/``; ``ops`` holds the sparse tensor
operations (BF16 gather, sortedness check) that run on them or on an exact torch path.
"""
