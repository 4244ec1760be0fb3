from art_sky.cli import app

app()
