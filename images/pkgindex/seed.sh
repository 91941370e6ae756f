#!/bin/sh
# Image build only: fetch the packages of npm-seeds.txt with `npm pack`, check each tarball's
# sha512, and publish it into verdaccio's storage through a verdaccio started here, with the one
# build-time user its registration allows (the served config closes registration; the user's
# password file is removed after).
set -eu
SEEDS=$1
mkdir -p /tmp/seed && cd /tmp/seed
grep -v '^#' "$SEEDS" | while read -r name version sha512; do
    [ -n "$name" ] || continue
    file=$(npm pack --silent "$name@$version")
    echo "$sha512  $file" | sha512sum -c -
    # A publishConfig could send the publish elsewhere than the local verdaccio.
    if tar -xzOf "$file" package/package.json | grep -q '"publishConfig"'; then
        echo "seed $name@$version has a publishConfig: refused"; exit 1
    fi
    echo "$file" >> /tmp/seed/files
done
sed 's/max_users: -1/max_users: 1/' /etc/verdaccio/config.yaml > /tmp/seed/config.yaml
/opt/verdaccio/node_modules/.bin/verdaccio --config /tmp/seed/config.yaml --listen 127.0.0.1:4873 &
pid=$!
url=http://127.0.0.1:4873
curl -fsS --retry 60 --retry-connrefused --retry-delay 1 -o /dev/null "$url/-/ping"
token=$(curl -fsS -X PUT -H 'content-type: application/json' \
    -d '{"name": "seed", "password": "seed-at-build-only"}' "$url/-/user/org.couchdb.user:seed" |
    node -e 'let s = ""; process.stdin.on("data", d => s += d).on("end", () => console.log(JSON.parse(s).token))')
while read -r file; do
    npm publish "/tmp/seed/$file" --registry "$url/" "--//127.0.0.1:4873/:_authToken=$token" \
        --ignore-scripts --access public
done < /tmp/seed/files
kill "$pid"; wait "$pid" || true
rm -f /srv/verdaccio/htpasswd
rm -rf /tmp/seed
