//go:build ignore

// release-proxy serves the working tree as a release: it writes a module
// proxy into a directory (the layout that GOPROXY=file://DIR reads:
// DIR/<module>/@v/list, VERSION.info, VERSION.mod and VERSION.zip) with
// every module of the repository at one version, made from the files git
// would commit (tracked files, and untracked ones that .gitignore does not
// ignore, as they are in the working tree), and a copy of each module's
// files under SRC/<module directory with / as _>.
//
// Before writing anything it checks what a published module needs: every
// requirement of a module of the repository names the release version (a
// pseudo-version or v0.0.0 cannot be fetched by a user), no go.mod has a
// replace directive (a user's build ignores it: one that points into the
// repository hides a requirement that only resolves here), and go.work uses
// every module and replaces nothing but a module of the repository at the
// release version with its own directory.
//
// Usage (scripts/check-release.sh builds it in a module of its own that
// requires golang.org/x/mod):
//
//	release-proxy -repo DIR -out PROXYDIR -src SRCDIR
//
// It prints the release version (the one the go.mod files require) and then
// one line per module: its directory, its path, and the name of its copy
// under SRCDIR. It exits 1 when a check fails, 2 on an error.
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
	"golang.org/x/mod/semver"
	modzip "golang.org/x/mod/zip"
)

// baselineDir holds the API baseline of scripts/check-api.sh, with a go.mod
// of its own that keeps it out of the root module's zip: its files are in
// no module.
const baselineDir = "api"

type mod struct {
	dir   string // relative to the repository, "." for the root
	path  string
	gomod []byte
	file  *modfile.File
	files []string // relative to the repository
}

func main() {
	repo := flag.String("repo", ".", "the repository's top directory")
	out := flag.String("out", "", "the proxy directory to write")
	src := flag.String("src", "", "the directory to copy each module's files into")
	flag.Parse()
	if *out == "" || *src == "" {
		fmt.Fprintln(os.Stderr, "usage: release-proxy -repo DIR -out PROXYDIR -src SRCDIR")
		os.Exit(2)
	}
	if err := run(*repo, *out, *src); err != nil {
		fmt.Fprintln(os.Stderr, "release-proxy:", err)
		os.Exit(2)
	}
}

func run(repo, out, src string) error {
	abs, err := filepath.Abs(repo)
	if err != nil {
		return err
	}
	// safe.directory: the repository may belong to another user (a check
	// run as an unprivileged user on root's checkout).
	ls := exec.Command("git", "-c", "safe.directory="+abs, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
	ls.Dir = repo
	ls.Stderr = os.Stderr
	listing, err := ls.Output()
	if err != nil {
		return fmt.Errorf("git ls-files: %w", err)
	}
	var files []string
	for _, f := range strings.Split(string(listing), "\x00") {
		if f == "" {
			continue
		}
		if fi, err := os.Lstat(filepath.Join(repo, f)); err != nil || !fi.Mode().IsRegular() {
			continue // deleted in the working tree, or a symlink (never in a module zip)
		}
		files = append(files, f)
	}
	sort.Strings(files)

	mods := map[string]*mod{} // by directory
	for _, f := range files {
		if path.Base(f) != "go.mod" {
			continue
		}
		if path.Dir(f) == baselineDir {
			continue
		}
		data, err := os.ReadFile(filepath.Join(repo, f))
		if err != nil {
			return err
		}
		mf, err := modfile.Parse(f, data, nil)
		if err != nil {
			return err
		}
		if mf.Module == nil {
			return fmt.Errorf("%s: no module line", f)
		}
		mods[path.Dir(f)] = &mod{dir: path.Dir(f), path: mf.Module.Mod.Path, gomod: data, file: mf}
	}
	if mods["."] == nil {
		return fmt.Errorf("no go.mod at the top of %s", repo)
	}
	for _, f := range files {
		if strings.HasPrefix(f, baselineDir+"/") {
			continue
		}
		owner := "."
		for d := path.Dir(f); d != "."; d = path.Dir(d) {
			if mods[d] != nil {
				owner = d
				break
			}
		}
		mods[owner].files = append(mods[owner].files, f)
	}
	var dirs []string
	byPath := map[string]*mod{}
	for d, m := range mods {
		dirs = append(dirs, d)
		byPath[m.path] = m
	}
	sort.Strings(dirs)

	// The release version: the one every requirement of a module of the
	// repository names.
	var problems []string
	versions := map[string][]string{}
	for _, d := range dirs {
		m := mods[d]
		for _, r := range m.file.Require {
			if byPath[r.Mod.Path] == nil {
				continue
			}
			v := r.Mod.Version
			where := fmt.Sprintf("%s requires %s %s", path.Join(d, "go.mod"), r.Mod.Path, v)
			switch {
			case module.IsPseudoVersion(v):
				problems = append(problems, where+": a pseudo-version, which a user cannot fetch")
			case v == "v0.0.0" || semver.Canonical(v) != v:
				problems = append(problems, where+": not a version to release (vMAJOR.MINOR.PATCH, above v0.0.0)")
			}
			versions[v] = append(versions[v], where)
		}
		for _, r := range m.file.Replace {
			problems = append(problems, fmt.Sprintf("%s: replace %s => %s: a user's build ignores it; the workspace (go.work) resolves the modules of the repository",
				path.Join(d, "go.mod"), r.Old.Path, strings.TrimSpace(r.New.Path+" "+r.New.Version)))
		}
	}
	var version string
	switch len(versions) {
	case 0:
		return fmt.Errorf("no module of the repository requires another: nothing names the release version")
	case 1:
		for v := range versions {
			version = v
		}
	default:
		var vs []string
		for v, where := range versions {
			vs = append(vs, fmt.Sprintf("%s (%s)", v, strings.Join(where, "; ")))
		}
		sort.Strings(vs)
		problems = append(problems, "the modules require each other at different versions: "+strings.Join(vs, ", ")+"; scripts/set-version.sh sets one")
	}

	// go.work: every module, and replacements of the release version only.
	if data, err := os.ReadFile(filepath.Join(repo, "go.work")); err != nil {
		problems = append(problems, "go.work: "+err.Error())
	} else if wf, err := modfile.ParseWork("go.work", data, nil); err != nil {
		return err
	} else {
		used := map[string]bool{}
		for _, u := range wf.Use {
			used[path.Clean(u.Path)] = true
		}
		for _, d := range dirs {
			if !used[d] {
				problems = append(problems, fmt.Sprintf("go.work does not use %s", d))
			}
			delete(used, d)
		}
		for u := range used {
			problems = append(problems, fmt.Sprintf("go.work uses %s, which is not a module of the repository", u))
		}
		for _, r := range wf.Replace {
			m := byPath[r.Old.Path]
			switch {
			case m == nil:
				problems = append(problems, fmt.Sprintf("go.work replaces %s, not a module of the repository", r.Old.Path))
			case version == "":
				// The requirements disagree: reported above.
			case r.Old.Version != version:
				problems = append(problems, fmt.Sprintf("go.work replaces %s at %q, not at the release version %s", r.Old.Path, r.Old.Version, version))
			case r.New.Version != "" || path.Clean(r.New.Path) != path.Clean("./"+m.dir):
				problems = append(problems, fmt.Sprintf("go.work replaces %s %s with %s, not with ./%s", r.Old.Path, r.Old.Version, r.New.Path, m.dir))
			}
		}
	}
	if len(problems) > 0 {
		for _, p := range problems {
			fmt.Fprintln(os.Stderr, "release:", p)
		}
		os.Exit(1)
	}

	info, err := json.Marshal(struct {
		Version string
		Time    time.Time
	}{version, time.Now().UTC().Truncate(time.Second)})
	if err != nil {
		return err
	}
	fmt.Println(version)
	for _, d := range dirs {
		m := mods[d]
		esc, err := module.EscapePath(m.path)
		if err != nil {
			return err
		}
		vdir := filepath.Join(out, filepath.FromSlash(esc), "@v")
		if err := os.MkdirAll(vdir, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(vdir, "list"), []byte(version+"\n"), 0o644); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(vdir, version+".info"), info, 0o644); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(vdir, version+".mod"), m.gomod, 0o644); err != nil {
			return err
		}
		var zfiles []modzip.File
		copyName := "root"
		if d != "." {
			copyName = strings.ReplaceAll(d, "/", "_")
		}
		copyDir := filepath.Join(src, copyName)
		for _, f := range m.files {
			rel := f
			if d != "." {
				rel = strings.TrimPrefix(f, d+"/")
			}
			zfiles = append(zfiles, zipFile{rel: rel, abs: filepath.Join(repo, f)})
		}
		var zbuf bytes.Buffer
		if err := modzip.Create(&zbuf, module.Version{Path: m.path, Version: version}, zfiles); err != nil {
			return fmt.Errorf("zip of %s: %w", m.path, err)
		}
		if err := os.WriteFile(filepath.Join(vdir, version+".zip"), zbuf.Bytes(), 0o644); err != nil {
			return err
		}
		// The copy holds what the zip holds.
		if err := os.MkdirAll(copyDir, 0o755); err != nil {
			return err
		}
		if err := modzip.Unzip(copyDir, module.Version{Path: m.path, Version: version}, filepath.Join(vdir, version+".zip")); err != nil {
			return fmt.Errorf("unzip of %s: %w", m.path, err)
		}
		// Unzip makes the files read-only, as in the module cache; the
		// checks write go.sum, and a user who is not root could not.
		err = filepath.WalkDir(copyDir, func(p string, e fs.DirEntry, err error) error {
			if err != nil || e.IsDir() {
				return err
			}
			return os.Chmod(p, 0o644)
		})
		if err != nil {
			return err
		}
		fmt.Printf("%s %s %s\n", d, m.path, copyName)
	}
	return nil
}

// zipFile is a file of the working tree, named by its path in the module.
type zipFile struct{ rel, abs string }

func (f zipFile) Path() string                 { return f.rel }
func (f zipFile) Lstat() (os.FileInfo, error)  { return os.Lstat(f.abs) }
func (f zipFile) Open() (io.ReadCloser, error) { return os.Open(f.abs) }
