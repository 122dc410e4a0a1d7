"""The harmony format of gpt-oss models: chats rendered as harmony, replies read back by channel."""
