"""What a path is: the grid of modules (`topology`) and the Hugging Face model one path runs (`path_model`).

Imports only `dipaco.config`; no store, no training, no files but safetensors parameters.
"""
