"""A Hugging Face tokenizer built here (no download): byte-level BPE trained on
a few of the standard library's sources, with Llama's conventions (a BOS before
each text, an EOS token), saved with save_pretrained like a Hub tokenizer."""
import pathlib
import sysconfig


def save_tokenizer(directory, vocab: int = 400) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    sources = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]
    tok.train_from_iterator((p.read_text(errors="replace") for p in sources), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(directory))
    return str(directory)
