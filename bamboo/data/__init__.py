"""Training data: token files and byte corpora split into microbatches (corpus),
remote objects named by URL (objects) and their local cache. It imports only the
standard library, numpy and torch; the model and runtime rooms read data through it."""
