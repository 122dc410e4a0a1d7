"""What `tandem serve` uses when neither a flag nor the config says otherwise."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_APP_NAME = "tandem"
IMPORT_PATH = "tandem.deploy.app:build_app"  # the serve-config import path that `tandem serve` deploys
