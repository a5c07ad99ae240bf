"""Prompt layout `S | C1 | ... | Ck | Q` as token ids, built from the tokenizer's chat template.

Every segment is tokenised on its own and the prompt is their concatenation. Full prefill sees the
very same ids as the fused path, which is what makes "ratio 1.0 equals full prefill" exact.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvf.errors import KvfError

SYSTEM_PROMPT = ("You are a helpful assistant. Answer the question using the documents below. "
                 "Reply with the answer only, in a few words.")
DOCS_MARKER = "\x00KVF_DOCUMENTS\x00"  # cut points inside the rendered chat template (not whitespace: a template
QUESTION_MARKER = "\x00KVF_QUESTION\x00"  # that trims each message, as Llama-3's does, keeps what lies between them)
CHUNK_SEPARATOR = "\n\n"  # appended to every chunk so neighbouring chunks do not run together


@dataclass
class PromptTemplate:
    """The parts of the prompt that do not depend on the chunks."""
    prefix_ids: list[int]              # S: chat head, system prompt, "Documents:" (shared by all prompts)
    question_head: str                 # text before the question inside the user turn
    question_tail: str                 # chat tail up to the assistant's turn
    separator_ids: list[int]           # CHUNK_SEPARATOR as ids
    tokenizer: object = field(repr=False)
    stop_strings: tuple[str, ...] = ()  # where an answer ends besides an end-of-turn token (a base model's: its line)

    def question_ids(self, question: str) -> list[int]:
        if not question or not question.strip():
            raise KvfError("empty question: pass a non-empty question text")
        asked = self.question_head + question.strip()
        as_text = encode(self.tokenizer, asked, split_special_tokens=True)
        if as_text == encode(self.tokenizer, asked):   # no control token's text in it: one piece, as always
            return encode(self.tokenizer, asked + self.question_tail)
        # "what does <|im_end|> mean?" asks about that text: it stays text, as in a chunk, and does not end the turn
        return as_text + encode(self.tokenizer, self.question_tail)

    def chunk_segment(self, chunk_token_ids: list[int]) -> list[int]:
        """A chunk as it sits in the prompt (and as its KV is stored): its ids plus the separator."""
        return list(chunk_token_ids) + self.separator_ids


def encode(tokenizer, text: str, split_special_tokens: bool = False) -> list[int]:
    """Token ids, no BOS/EOS added; split_special_tokens: a control token's text (e.g. "<|im_end|>") stays text."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=split_special_tokens)["input_ids"]


def make_template(tokenizer, system_prompt: str = SYSTEM_PROMPT) -> PromptTemplate:
    """Render the chat template around a marker and cut it into S and the question's frame."""
    user_turn = "Documents:\n" + DOCS_MARKER + "Question: " + QUESTION_MARKER
    chat = bool(getattr(tokenizer, "chat_template", None))
    if chat:
        rendered = render_chat(tokenizer, system_prompt, user_turn)
    else:  # base models: a plain layout, and no end of turn: the answer is the line after "Answer:"
        rendered = f"{system_prompt}\n\n{user_turn}\nAnswer:"
    if rendered.count(DOCS_MARKER) != 1 or rendered.count(QUESTION_MARKER) != 1:
        raise KvfError("the model's chat template does not keep the user's message as written; pass a --model whose "
                       "tokenizer_config.json has a chat template that does, or none (a plain prompt)")
    head, tail = rendered.split(DOCS_MARKER)
    question_head, question_tail = tail.split(QUESTION_MARKER)
    bos = [tokenizer.bos_token_id] if _template_lacks_bos(tokenizer, rendered) else []
    return PromptTemplate(prefix_ids=bos + encode(tokenizer, head),
                          question_head=question_head, question_tail=question_tail,
                          separator_ids=encode(tokenizer, CHUNK_SEPARATOR), tokenizer=tokenizer,
                          stop_strings=() if chat else ("\n",))


def render_chat(tokenizer, system_prompt: str, user_turn: str) -> str:
    """The chat template's text for a system message and one user turn, up to the assistant's turn. Some templates
    take no system role: Mistral-Instruct v0.1/v0.2's and Gemma's raise, others drop it. Those models' own cards put
    the instructions at the head of the user turn, and so does this."""
    from jinja2.exceptions import TemplateError

    def render(messages: list[dict]) -> str:   # a thinking model (Qwen3) answers at once: kvf scores short answers
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)

    try:
        rendered = render([{"role": "system", "content": system_prompt}, {"role": "user", "content": user_turn}])
        if system_prompt in rendered:
            return rendered
    except TemplateError:
        pass
    try:
        return render([{"role": "user", "content": f"{system_prompt}\n\n{user_turn}"}])
    except TemplateError as e:
        raise KvfError(f"the model's chat template cannot render one user turn ({e}); pass a --model whose "
                       "tokenizer_config.json has a chat template for a user's message, or none (a plain prompt)") from None


def _template_lacks_bos(tokenizer, rendered: str) -> bool:
    """Llama-style tokenizers add BOS themselves; we encode without special tokens, so add it here."""
    bos = getattr(tokenizer, "bos_token", None)
    return bool(bos) and getattr(tokenizer, "add_bos_token", False) and not rendered.startswith(bos)


@dataclass
class FusedPrompt:
    """One question's prompt: token ids by segment and where each segment sits."""
    prefix_ids: list[int]
    chunk_segments: list[list[int]]
    question_ids: list[int]

    @property
    def n_prefix(self) -> int:
        return len(self.prefix_ids)

    @property
    def n_tokens(self) -> int:
        return self.n_prefix + sum(len(c) for c in self.chunk_segments) + len(self.question_ids)

    @property
    def n_chunk_tokens(self) -> int:
        return sum(len(c) for c in self.chunk_segments)

    def chunk_spans(self) -> list[tuple[int, int]]:
        """[start, end) rows of each chunk in the prompt."""
        spans, start = [], self.n_prefix
        for seg in self.chunk_segments:
            spans.append((start, start + len(seg)))
            start += len(seg)
        return spans

    def question_rows(self) -> torch.Tensor:
        return torch.arange(self.n_tokens - len(self.question_ids), self.n_tokens)

    def positions_used(self, positions: torch.Tensor | None = None) -> int:
        """RoPE positions the prompt takes: n_tokens when contiguous, else the highest of `positions` + 1
        (methods that let chunks share positions, like pcw, take fewer)."""
        return self.n_tokens if positions is None else int(positions.max()) + 1

    def overflow_fix(self, limit: int, fewer: str) -> tuple[str, str]:
        """(why, fix) for a prompt past the model's `limit` positions. A question that alone takes half of them is
        the cause whatever the chunks are, so its fix is a shorter question; else `fewer` (context) or fewer new tokens."""
        if len(self.question_ids) > limit // 2:
            return f" (the question alone is {len(self.question_ids)} tokens)", "shorten the question"
        return "", f"{fewer} or lower --max-new-tokens"

    def all_ids(self) -> torch.Tensor:
        ids = list(self.prefix_ids)
        for seg in self.chunk_segments:
            ids += seg
        return torch.tensor(ids + list(self.question_ids))


def build_prompt(template: PromptTemplate, chunks: list[list[int]], question: str) -> FusedPrompt:
    """chunks = raw chunk token ids in prompt order."""
    return FusedPrompt(list(template.prefix_ids), [template.chunk_segment(c) for c in chunks],
                       template.question_ids(question))
