"""The serving edge: the OpenAI API on Ray Serve (`app.build_app`) and the `tandem` command."""
