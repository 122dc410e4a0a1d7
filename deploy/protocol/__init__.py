"""The OpenAI protocol: request bodies and their fields, the jobs they become, responses and errors."""
