"""Request and response bodies of the embedding and rerank routes (lockstep.entrypoints.
embedding_routes), as OpenAI (/v1/embeddings), SGLang (/encode, /v1/rerank) and Jina/Cohere
(/rerank, /v2/rerank) define them. Unknown fields are a 400, as everywhere."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from lockstep.entrypoints.generate_request import IdsInput, StrictModel, TextInput
from lockstep.entrypoints.openai.protocol import PromptInput


class EmbeddingRequest(StrictModel):
    """OpenAI's POST /v1/embeddings."""

    input: PromptInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    # Truncate to this many dimensions and normalize again: only for models trained for it
    # (Matryoshka: config.json's matryoshka_dimensions); a 400 otherwise.
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None  # OpenAI's end-user id: recorded nowhere, as it changes no output

    def prompts(self) -> list[tuple[str | None, list[int] | None]]:  # (text, ids) per input
        p = self.input
        many = p if isinstance(p, list) and isinstance(p[0], (str, list)) else [p]
        return [(x, None) if isinstance(x, str) else (None, x) for x in many]


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format base64


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class EncodeRequest(StrictModel):
    """SGLang's native /encode (its EmbeddingReqInput): text or input_ids, one or a batch."""

    text: TextInput | None = None
    input_ids: IdsInput | None = None
    rid: str | list[str] | None = None

    def prompts(self) -> tuple[bool, list[tuple[str | None, list[int] | None]]]:
        """(whether it is a batch, (text, ids) per input)."""
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        if self.text is not None:
            many = isinstance(self.text, list)
            return many, [(t, None) for t in (self.text if many else [self.text])]
        ids: Any = self.input_ids
        many = isinstance(ids[0], list)
        return many, [(None, x) for x in (ids if many else [ids])]


class EncodeResponse(BaseModel):
    embedding: list[float]
    meta_info: dict[str, Any]
    index: int | None = None


class RerankDocument(StrictModel):
    text: str


class RerankRequest(StrictModel):
    """SGLang's /v1/rerank and Jina's / Cohere's /rerank, /v2/rerank: one query, its documents
    (strings, or Cohere's {"text": ...} objects), the best top_n of them back."""

    query: str
    documents: list[str | RerankDocument] = Field(min_length=1)
    model: str | None = None
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    # SGLang's: the task a yes/no reranker (Qwen3-Reranker) judges each pair for; None: its
    # model card's default (web search). A cross-encoder has no instruction: a 400.
    instruct: str | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class SGLangRerankResult(BaseModel):
    """One entry of SGLang's /v1/rerank reply (a list, best first)."""

    score: float
    index: int
    document: str | None = None
    meta_info: dict[str, Any]


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    """Jina's / Cohere's (and vLLM's, llama-server's) rerank reply."""

    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ScoreRequest(StrictModel):
    """SGLang's /v1/score: the probability a generative model gives each label token right after
    query + item (item + query with item_first), per item."""

    query: str | list[int]
    items: str | list[str] | list[list[int]]
    label_token_ids: list[int] = Field(min_length=1)
    apply_softmax: bool = False  # normalize over the labels instead of plain probabilities
    item_first: bool = False
    model: str | None = None


class ScoreResponse(BaseModel):
    scores: list[list[float]]
    model: str
    usage: dict[str, int]
    object: Literal["scoring"] = "scoring"
