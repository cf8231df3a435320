"""Tiny tool-calling models for the TRL tests, built from a config (no hub): a byte-level tokenizer with ChatML's
special tokens and Qwen2.5's chat template (which renders tools and tool calls, and which TRL knows how to parse),
a random Llama over it, and :func:`teach` to make such a model call given tools by training it on conversations."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tool_chat_tokenizer(corpus: Sequence[str] = (), vocab_size: int = 1024):
    """A byte-level BPE tokenizer (any text round-trips, so tool-call JSON decodes exactly) with ``<|endoftext|>``
    as padding, ``<|im_end|>`` as end of turn and TRL's copy of Qwen2.5's chat template. Its merges are learnt
    from ``corpus`` (none: one token per byte), so that conversations like it are a few hundred tokens, not
    thousands: a tiny model learns them in seconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen2_5_chat_template

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    if corpus:
        core = Tokenizer(models.BPE())
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                                             special_tokens=list(CHATML_TOKENS), show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=CHATML_TOKENS[0], eos_token=CHATML_TOKENS[2],
                                        additional_special_tokens=list(CHATML_TOKENS[1:2]))
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def tiny_tool_model(path: Path, tokenizer=None, hidden: int = 64, layers: int = 2, seed: int = 0,
                    context: int = 4096) -> Path:
    """A random tiny Llama + ``tokenizer`` (default: :func:`tool_chat_tokenizer` without merges), saved at
    ``path``, for contexts of up to ``context`` tokens (TRL drops a tool result that would pass the model's
    ``max_position_embeddings``; Llama's rotary positions have no weights, so raising it changes nothing else)."""
    from transformers import AutoConfig

    from stppo_agent.models.tiny import build_tiny_llama

    tokenizer = tokenizer if tokenizer is not None else tool_chat_tokenizer()
    build_tiny_llama(path, tokenizer, hidden=hidden, layers=layers, seed=seed)
    config = AutoConfig.from_pretrained(path)
    config.max_position_embeddings = context
    config.save_pretrained(path)
    return Path(path)


def assistant_spans(tokenizer, messages: list[dict], tools: list) -> tuple[list[int], list[tuple[int, int]]]:
    """(the token ids of the whole conversation, the [start, end) of every assistant message in them), each span
    being what the model generates after the template's ``<|im_start|>assistant\\n``: its text up to and with
    ``<|im_end|>``."""
    def render(upto: int, generation_prompt: bool) -> list[int]:
        return tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=True, return_dict=False,
                                             add_generation_prompt=generation_prompt)

    ids, spans = render(len(messages), False), []
    for position, message in enumerate(messages):
        if message["role"] == "assistant":
            start, end = len(render(position, True)), len(render(position + 1, False))
            assert ids[:end][:start] == render(position, True), "the chat template is not prefix-preserving"
            spans.append((start, end - 1))  # the template's "\n" after <|im_end|> is not generated
    return ids, spans


def teach(path: Path, conversations: list[list[dict]], tools: list, steps: int = 300, lr: float = 3e-3,
          seed: int = 0) -> float:
    """Train the model at ``path`` (in place) on the assistant messages of ``conversations`` until it says them
    after their contexts; returns the last step's mean loss per assistant token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    rows = [assistant_spans(tokenizer, messages, tools) for messages in conversations]
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for row, (ids, spans) in enumerate(rows):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        for start, end in spans:
            labels[row, start:end] = input_ids[row, start:end]
    attention = (torch.arange(width)[None, :] < torch.tensor([len(ids) for ids, _ in rows])[:, None]).long()
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)
    return float(loss.detach())


def environment_tools(environment) -> list:
    """The tools TRL offers for ``environment``, in TRL's order: its public methods but ``reset`` and
    ``get_reward``, by name (the order of the schemas in the system prompt, which a taught model depends on)."""
    import inspect

    return [getattr(environment, name) for name, _ in inspect.getmembers(type(environment), inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


def message_logprob(model, tokenizer, messages: list[dict], tools: list, which: int) -> float:
    """log p of the ``which``-th assistant message of ``messages`` (its tokens up to ``<|im_end|>``) given the
    conversation before it."""
    import torch

    ids, spans = assistant_spans(tokenizer, messages, tools)
    start, end = spans[which]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:end]])).logits[0].float()
    logprobs = torch.log_softmax(logits[start - 1:end - 1], dim=-1)
    return float(logprobs.gather(-1, torch.tensor(ids[start:end])[:, None]).sum())
