"""Interactive client of the text generation server: ``python tools/text_generation_cli.py host:port``."""
import json
import sys
import urllib.error
import urllib.request


def put(url, prompt, tokens_to_generate):
    body = json.dumps({"prompts": [prompt], "tokens_to_generate": tokens_to_generate}).encode()
    req = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as response:
        return json.loads(response.read().decode())


def main(argv):
    if len(argv) != 1:
        print("usage: python tools/text_generation_cli.py host:port", file=sys.stderr)
        return 2
    url = "http://" + argv[0] + "/api"
    while True:
        try:
            sentence = input("Enter prompt: ")
            tokens_to_generate = int(input("Enter number of tokens to generate: ") or "64")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        except ValueError:
            print("the number of tokens must be an integer")
            continue
        try:
            response = put(url, sentence, tokens_to_generate)
        except urllib.error.HTTPError as e:
            print(f"Error {e.code}: {e.read().decode()}")
            continue
        except urllib.error.URLError as e:
            print(f"could not reach {url}: {e.reason}")
            return 1
        print("Megatron Response: ")
        print(response["text"][0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
