"""Data in, tensors out: built-in datasets (rendered with Pillow), user folders and label files, image decoding with
limits (`imagedecode`), the one pre-processing path (`preprocess`) shared by training, bundles and serving, and crops.

Imports only `core`.
"""
