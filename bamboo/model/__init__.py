"""Models as ordered lists of layers: the built-in GPT/BERT-style transformer
(builtin), factories for a user's own `nn.Sequential`, Hugging Face models (hf), the
user API that names them, the training recipe (optimizer, schedule, clipping, loss
scale), partitioning into stages and export. It imports only `data`: a model is
built the same on a worker, in the reference run and in an export."""
