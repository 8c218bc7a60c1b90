"""OpenAI's Responses API (/v1/responses), translated to the chat-completion path: protocol.py
(the request and reply shapes, read from openai==3.63.0's types/responses), translate.py
(request -> chat request, chat choice -> output items), events.py (the stream's event
sequence), store.py (stored responses), serving.py (the route's work)."""
