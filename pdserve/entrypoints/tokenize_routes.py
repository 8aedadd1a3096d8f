"""vLLM's ``POST /tokenize``, ``POST /detokenize`` and ``GET /version`` routes of an engine's
server, with vLLM's request and response shapes (``vllm bench serve`` asks ``/tokenize`` to
align its random prompts to the server's tokenizer)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from pdserve import __version__
from pdserve.entrypoints.errors import bad_request, model_not_found, validation_error_to_openai
from pdserve.entrypoints.protocol import ChatMessage

__all__ = ["TokenizeChatRequest", "TokenizeCompletionRequest", "DetokenizeRequest",
           "tokenize_router"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class TokenizeCompletionRequest(_Body):
    """``/tokenize`` of a text prompt (vLLM's ``TokenizeCompletionRequest``)."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Body):
    """``/tokenize`` of a conversation rendered by the chat template (vLLM's
    ``TokenizeChatRequest``)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    """``/detokenize`` of token ids (vLLM's ``DetokenizeRequest``)."""

    model: str | None = None
    tokens: list[int]


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise bad_request("request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise validation_error_to_openai(e.errors()) from None


def tokenize_router(tokenizer: Any, model_name: str, max_model_len: int,
                    in_tokenizer_thread: Callable[..., Awaitable[Any]]) -> APIRouter:
    """The routes, for one served model.

    ``POST /tokenize``: ``{"model"?, "prompt", "add_special_tokens"=true,
    "return_token_strs"=false}`` or ``{"model"?, "messages", "add_generation_prompt"=true,
    "continue_final_message"=false, "add_special_tokens"=false, "chat_template_kwargs"?}`` ->
    ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` null unless asked).
    ``POST /detokenize``: ``{"model"?, "tokens"}`` -> ``{"prompt"}``. ``GET /version`` ->
    ``{"version"}``. Errors are OpenAI-style: 404 for another model name, 400 for a bad body,
    a model without a chat template (``messages``) or token ids outside the vocabulary.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        model_name: the served model name (``--served-model-name`` or the model).
        max_model_len: the engine's longest prompt + output, in tokens.
        in_tokenizer_thread: runs ``fn(*args)`` on the server's tokenizer thread (one thread
            for every use of the tokenizer).
    """
    router = APIRouter()

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise model_not_found(name, model_name)

    def encode_chat(req: TokenizeChatRequest) -> list[int]:
        messages = []
        for m in req.messages:
            d = m.model_dump(exclude_none=True)
            d["content"] = m.text() or ""
            messages.append(d)
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **(req.chat_template_kwargs or {}))
        return tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await _body(request)
        req: TokenizeChatRequest | TokenizeCompletionRequest
        if "messages" in body:
            req = _parse(TokenizeChatRequest, body)
            check_model(req.model)
            if not getattr(tokenizer, "chat_template", None):
                raise bad_request("This model has no chat template; use /v1/completions.",
                                  param="messages")
            try:
                ids = await in_tokenizer_thread(encode_chat, req)
            except Exception as e:  # noqa: BLE001 - jinja2 errors come in several types
                raise bad_request(f"Could not apply the chat template: {e}",
                                  param="messages") from e
        else:
            req = _parse(TokenizeCompletionRequest, body)
            check_model(req.model)
            ids = await in_tokenizer_thread(tokenizer.encode, req.prompt,
                                            add_special_tokens=req.add_special_tokens)
        ids = [int(i) for i in ids]
        strs = (await in_tokenizer_thread(tokenizer.convert_ids_to_tokens, ids)
                if req.return_token_strs else None)
        return JSONResponse({"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                             "token_strs": strs})

    @router.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = _parse(DetokenizeRequest, await _body(request))
        check_model(req.model)
        vocab = len(tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids outside the vocabulary of {vocab}: {bad[:5]}",
                              param="tokens")
        text = await in_tokenizer_thread(tokenizer.decode, req.tokens)
        return JSONResponse({"prompt": text})

    @router.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    return router
