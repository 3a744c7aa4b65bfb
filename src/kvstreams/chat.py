"""Token-in/token-out chat formatting.

Episodes grow by appending tokens: the model's own tokens are never re-tokenized, and environment
messages are rendered with the model's chat template *as a continuation* (the text the template would
put after an assistant reply) and appended verbatim. The pieces are found by rendering small probe
conversations and taking text differences, so any ChatML-like template works.
"""

from __future__ import annotations

from kvstreams.envs.base import Message
from kvstreams.errors import KVStreamsError

_U = "kvstreams-probe-user"
_A = "kvstreams-probe-assistant"


class ChatFormat:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise KVStreamsError("the tokenizer has no chat template; multi-turn episodes need one")
        user = [{"role": "user", "content": _U}]
        plain = self._render(user, generation_prompt=False)
        prompted = self._render(user, generation_prompt=True)
        if not prompted.startswith(plain):
            raise KVStreamsError("unsupported chat template: the generation prompt is not a suffix")
        self.header_text = prompted[len(plain) :]
        with_reply = self._render([*user, {"role": "assistant", "content": _A}], generation_prompt=False)
        after = with_reply[with_reply.index(_A) + len(_A) :]
        eot = self._end_of_turn_token()
        if not after.startswith(eot):
            raise KVStreamsError(f"unsupported chat template: an assistant turn does not end with {eot!r}")
        self.after_eot_text = after[len(eot) :]
        self._with_reply = with_reply
        self.end_of_turn = tokenizer.convert_tokens_to_ids(eot)

    def _end_of_turn_token(self) -> str:
        for candidate in ("<|im_end|>", "<|eot_id|>", "</s>"):
            if candidate in self.tokenizer.get_vocab():
                return candidate
        return self.tokenizer.eos_token

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def head(self, messages: list[Message]) -> list[int]:
        """The opening messages (system + task), without the assistant header."""
        return self.encode(self._render(messages, generation_prompt=False))

    def assistant_header(self) -> list[int]:
        return self.encode(self.header_text)

    def after_reply(self, messages: list[Message]) -> list[int]:
        """Messages following a model reply that ended with the end-of-turn token."""
        user = [{"role": "user", "content": _U}, {"role": "assistant", "content": _A}]
        full = self._render([*user, *messages], generation_prompt=False)
        return self.encode(self.after_eot_text + full[len(self._with_reply) :])

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)
