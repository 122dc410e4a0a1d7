"""The Serve app: the LLMServer deployment, its FastAPI routes, and the OpenAI service behind both."""
