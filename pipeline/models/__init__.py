"""Model builders chosen by name (`registry`): built-in CNN/CRNN/SVTR/LCNet/ViT/DBNet, and `imported` programs and
pretrained weights. Imports `core`, `engines` (an imported program's reference run), `data`.
"""
