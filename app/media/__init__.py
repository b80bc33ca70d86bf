"""Media from a request: which URLs may be fetched (url_policy), the fetch itself (fetch) and the bytes
behind any media URL (urls), by kind (kinds); decoding images (images) and videos (video: header checks
in video_checks, seeking frame decode in video_frames)."""
